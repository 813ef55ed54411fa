#!/usr/bin/env bash
# A two-"node" cluster on one machine: two network namespaces joined by a veth pair.
#
#   scripts/netns_cluster.sh up [--rate 100mbit|1gbit|unlimited]   create (or re-shape) the cluster
#   scripts/netns_cluster.sh down                                   remove everything this script made
#   scripts/netns_cluster.sh status                                 show namespaces, addresses, qdiscs
#
# Node 0 = namespace ${DISTPLAN_NETNS_PREFIX:-distplan_n}0 with veth end ${PREFIX}0v at 10.77.0.1/24,
# node 1 = namespace ${PREFIX}1 with ${PREFIX}1v at 10.77.0.2/24. Loopback is up in both. A limited
# rate puts a token bucket filter (tc tbf) on BOTH veth ends, so each direction is limited.
# Only addresses inside the namespaces this script creates are touched; the host's network is not.
#
# Run a torchrun "node" in each:
#   ip netns exec distplan_n0 env GLOO_SOCKET_IFNAME=distplan_n0v torchrun --nnodes 2 --node-rank 0 \
#       --nproc-per-node 1 --master-addr 10.77.0.1 --master-port 29500 ...
#
# Needs root or CAP_NET_ADMIN (and CAP_SYS_ADMIN for `ip netns add`). Where that is missing it says
# so and exits 77 (the conventional "skipped" status), changing nothing.
#
# Idempotent: `up` on an existing cluster only re-applies the rate; `down` on nothing is a no-op.
# `up` that fails half-way removes what it created (trap).
set -euo pipefail

PREFIX="${DISTPLAN_NETNS_PREFIX:-distplan_n}"
NS0="${PREFIX}0"
NS1="${PREFIX}1"
IF0="${PREFIX}0v"   # interface names are limited to 15 characters
IF1="${PREFIX}1v"
ADDR0="10.77.0.1"
ADDR1="10.77.0.2"
SKIP=77

usage() {
    sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
}

# die MESSAGE [HINT]: one line on stderr, exit 1
die() { echo "netns_cluster: error: $1${2:+ HINT: $2}" >&2; exit 1; }

check_prefix() {
    # Namespace names become files under /run/netns, interface names are at most 15 characters ("${PREFIX}0v").
    if ! [[ "$PREFIX" =~ ^[A-Za-z0-9][A-Za-z0-9_-]*$ ]]; then
        die "DISTPLAN_NETNS_PREFIX='$PREFIX' must start with a letter or digit and hold only letters, digits, '_' and '-'." "use e.g. DISTPLAN_NETNS_PREFIX=distplan_n"
    fi
    if [ ${#PREFIX} -gt 13 ]; then
        die "DISTPLAN_NETNS_PREFIX='$PREFIX' is ${#PREFIX} characters; the interface '${PREFIX}0v' must fit in 15." "use a prefix of 13 characters or fewer"
    fi
}

check_permitted() {
    if ! command -v ip >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1; then
        echo "netns_cluster: skipped: the 'ip' and 'tc' commands (iproute2) are not installed. HINT: apt-get install iproute2." >&2
        exit $SKIP
    fi
    # CAP_NET_ADMIN is bit 12 of the effective capability set.
    local capeff
    capeff=$(awk '/^CapEff:/ {print $2}' /proc/self/status 2>/dev/null || echo 0)
    if [ "$(id -u)" != 0 ] && (( (16#${capeff} >> 12 & 1) == 0 )); then
        echo "netns_cluster: skipped: network namespaces need root or CAP_NET_ADMIN (uid $(id -u), CapEff ${capeff}). HINT: run with sudo." >&2
        exit $SKIP
    fi
    # Capabilities can still be filtered (containers, seccomp): probe with a throw-away namespace.
    local probe="${PREFIX}_probe$$" err
    if ! err=$(ip netns add "$probe" 2>&1); then
        case "$err" in
            *"ermission"*|*"not permitted"*)  # EPERM / EACCES: a container without CAP_SYS_ADMIN, seccomp
                echo "netns_cluster: skipped: 'ip netns add' is not permitted here ($err). HINT: run on a host or a privileged container." >&2
                exit $SKIP ;;
            *) die "'ip netns add $probe' failed: $err" "check DISTPLAN_NETNS_PREFIX and /run/netns" ;;
        esac
    fi
    ip netns del "$probe" 2>/dev/null || true
}

ns_exists() { ip netns list 2>/dev/null | awk '{print $1}' | grep -qx -e "$1"; }

# tc tbf arguments for a rate. The burst is about 1 ms of line time (at least 16 KiB), so the link
# behaves like a wire of that rate: every message pays bytes/rate. A large bucket is not a wire: a
# 128 KiB burst at 100 Mbit/s let each pipeline message under 128 KiB through at veth speed, so
# pipelines paid nothing for their sends while back-to-back all-reduce traffic was limited
# (measured: demo Transformer 1f1b m=4 n=4, 516 KiB each way per step: 90 ms with a 128 KiB
# burst, 88 ms unlimited, 160 ms with 16 KiB). tbf segments GSO super-packets larger than the
# bucket (tbf_segment), and the kernel's high-resolution watchdog serves a small bucket on time.
# The latency bounds the queue.
tbf_args() {
    case "$1" in
        100mbit) echo "rate 100mbit burst 16k latency 50ms" ;;
        1gbit) echo "rate 1gbit burst 128k latency 50ms" ;;
        *) die "unknown rate '$1'" "use 100mbit, 1gbit or unlimited" ;;
    esac
}

apply_rate() {
    local rate="$1"
    for pair in "$NS0:$IF0" "$NS1:$IF1"; do
        local ns="${pair%%:*}" dev="${pair##*:}"
        ip -n "$ns" link set "$dev" txqueuelen 1000 2>/dev/null || true
        tc -n "$ns" qdisc del dev "$dev" root 2>/dev/null || true
        if [ "$rate" != unlimited ]; then
            # shellcheck disable=SC2046
            tc -n "$ns" qdisc add dev "$dev" root tbf $(tbf_args "$rate")
        fi
    done
}

cmd_down() {
    local removed=0
    for ns in "$NS0" "$NS1"; do
        if ns_exists "$ns"; then
            ip netns del "$ns" && removed=1   # deleting a namespace deletes its veth end, and so the pair
        fi
    done
    # a veth left in the root namespace by an interrupted `up`
    for dev in "$IF0" "$IF1"; do
        ip link show "$dev" >/dev/null 2>&1 && ip link del "$dev" 2>/dev/null && removed=1
    done
    if [ $removed = 1 ]; then echo "netns_cluster: down (removed $NS0, $NS1)"; else echo "netns_cluster: down (nothing to remove)"; fi
}

cmd_up() {
    local rate="$1"
    if ns_exists "$NS0" && ns_exists "$NS1" && ip -n "$NS0" link show "$IF0" >/dev/null 2>&1; then
        apply_rate "$rate"
        echo "netns_cluster: up (existing) $NS0=$ADDR0 $NS1=$ADDR1 rate=$rate"
        return
    fi
    cmd_down >/dev/null
    # Any failure from here on leaves nothing behind.
    trap 'status=$?; if [ $status -ne 0 ]; then echo "netns_cluster: up failed, cleaning up" >&2; cmd_down >/dev/null 2>&1 || true; fi' EXIT
    # Ctrl-C, kill or timeout half-way: exit non-zero, so the EXIT trap above cleans up too (bash skips it on a signal).
    trap 'exit 130' INT
    trap 'exit 143' TERM HUP
    ip netns add "$NS0"
    ip netns add "$NS1"
    ip link add "$IF0" type veth peer name "$IF1"
    ip link set "$IF0" netns "$NS0"
    ip link set "$IF1" netns "$NS1"
    ip -n "$NS0" addr add "$ADDR0/24" dev "$IF0"
    ip -n "$NS1" addr add "$ADDR1/24" dev "$IF1"
    for pair in "$NS0:$IF0" "$NS1:$IF1"; do
        local ns="${pair%%:*}" dev="${pair##*:}"
        ip -n "$ns" link set lo up
        ip -n "$ns" link set "$dev" up
    done
    apply_rate "$rate"
    if command -v ping >/dev/null 2>&1; then
        ip netns exec "$NS0" ping -c 1 -W 2 "$ADDR1" >/dev/null || die "$NS0 cannot reach $ADDR1 over the veth"
    else  # no ping installed: at least the carrier must be up on both ends
        ip -n "$NS0" link show "$IF0" | grep -q LOWER_UP || die "$IF0 in $NS0 has no carrier"
        ip -n "$NS1" link show "$IF1" | grep -q LOWER_UP || die "$IF1 in $NS1 has no carrier"
    fi
    trap - EXIT INT TERM HUP
    echo "netns_cluster: up $NS0=$ADDR0 ($IF0) $NS1=$ADDR1 ($IF1) rate=$rate"
}

cmd_status() {
    local up=1
    for pair in "$NS0:$IF0" "$NS1:$IF1"; do
        local ns="${pair%%:*}" dev="${pair##*:}"
        if ns_exists "$ns"; then
            local addr qdisc
            addr=$(ip -n "$ns" -4 -o addr show dev "$dev" 2>/dev/null | awk '{print $4}')
            qdisc=$(tc -n "$ns" qdisc show dev "$dev" 2>/dev/null | head -1)
            echo "$ns $dev ${addr:-no-address} | ${qdisc:-no qdisc}"
        else
            echo "$ns absent"
            up=0
        fi
    done
    [ $up = 1 ] && echo "netns_cluster: status up" || echo "netns_cluster: status down"
}

main() {
    [ $# -ge 1 ] || usage
    local action="$1"; shift
    local rate="unlimited"
    while [ $# -gt 0 ]; do
        case "$1" in
            --rate) [ $# -ge 2 ] || die "--rate needs a value." "use --rate 100mbit, 1gbit or unlimited"; rate="$2"; shift 2 ;;
            --rate=*) rate="${1#--rate=}"; shift ;;
            -h|--help) usage ;;
            *) die "unknown argument '$1'." "the only option is --rate 100mbit|1gbit|unlimited" ;;
        esac
    done
    case "$rate" in 100mbit|1gbit|unlimited) ;; *) die "--rate must be 100mbit, 1gbit or unlimited, got '$rate'." "use e.g. --rate 100mbit" ;; esac
    check_prefix
    case "$action" in
        up) check_permitted; cmd_up "$rate" ;;
        down) check_permitted; cmd_down ;;
        status) cmd_status ;;
        -h|--help|help) usage ;;
        *) die "unknown action '$action'." "use up, down or status" ;;
    esac
}

main "$@"
