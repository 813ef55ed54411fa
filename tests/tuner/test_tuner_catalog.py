"""Catalogs: the built-in tables and SkyPilot-style CSV parsing with its validation errors."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from lightning_distplan.costmodel.gpus import GPUS
from lightning_distplan.errors import CatalogError
from lightning_distplan.tuner.catalog import BUILTIN_CATALOGS, load_catalog, parse_catalog_csv, spot_priced


def test_alicloud_2023_is_seed_000_table_iii():
    cat = load_catalog("alicloud-2023")
    assert cat.currency == "RMB" and len(cat.instances) == 12
    rows = {i.instance_type: i for i in cat.instances}
    # spot checks straight from the table (vCPU, memory, GPU share, GPU memory, Gbps, RMB/hour)
    gn6i = rows["gn6i.xlarge"]
    assert (gn6i.vcpus, gn6i.memory_gb, gn6i.gpu, gn6i.gpus_per_instance, gn6i.gpu_memory_gb, gn6i.network_gbps, gn6i.price_per_hour) == (4, 15, "T4", 1.0, 16, 4, 11.67)
    vws = rows["vgn7i-vws.xlarge"]
    assert vws.gpu == "A10" and vws.gpus_per_instance == pytest.approx(1 / 6) and vws.gpu_memory_gb == 4 and vws.price_per_hour == 3.117
    sgn = rows["sgn7i.xlarge"]
    assert sgn.gpus_per_instance == pytest.approx(1 / 12) and sgn.network_gbps == 5 and sgn.price_per_hour == 1.875
    assert rows["gn6v.2xlarge"].network_gbps == 2.5 and rows["gn6v.2xlarge"].gpu == "V100"
    assert rows["gn7e.4xlarge"].gpu == "A100-80GB" and rows["gn7e.4xlarge"].price_per_hour == 34.742
    assert all("Table III" in i.source and i.date for i in cat.instances)
    # a shared GPU is one rank with that share of the card, the 4 GB it lists less ECC's 1/16 (GDDR6)
    assert vws.world_size(3) == 3 and vws.gpu_spec().memory_bytes == 4 * 1024**3 * 15 // 16
    assert gn6i.gpu_spec().memory_bytes == 15 * 1024**3  # a 16 GB T4: 15 GiB with ECC on
    assert rows["gn7e.4xlarge"].gpu_spec().memory_bytes == 80 * 1024**3  # HBM: ECC takes none of it


def test_aws_2026_rows_are_dated_and_priced_in_usd():
    cat = load_catalog("aws-2026")
    assert cat.currency == "USD" and len(cat.instances) == 11
    p4d = cat.get("p4d.24xlarge")
    assert (p4d.gpu, p4d.gpus_per_instance, p4d.price_per_hour, p4d.network_gbps) == ("A100-40GB", 8, 32.7726, 400)
    assert p4d.world_size(2) == 16
    assert cat.get("g5.xlarge").gpu == "A10G" and cat.get("p5en.48xlarge").gpu == "H200"
    assert all(i.date and i.source and i.network_source for i in cat.instances)


def test_aws_2026_up_to_bandwidths_are_marked_as_burst_peaks_and_said_so():
    """AWS lists the small instances' network as "Up to N Gbps"; the catalog prices N (no sustained figure is sourced)
    and said nowhere that N is a burst peak, so a multi-instance plan on them looked faster and cheaper than it runs."""
    from dataclasses import replace

    from lightning_distplan.tuner.search import _catalog_fingerprint

    cat = load_catalog("aws-2026")
    burst = {i.instance_type: i.network_gbps for i in cat.instances if i.network_burst}
    assert burst == {"g5.xlarge": 10, "g6.xlarge": 10, "g6e.xlarge": 20, "p3.2xlarge": 10}  # the figures stay as listed
    notes = cat.caveats()
    assert notes[: len(cat.notes)] == cat.notes and len(notes) == len(cat.notes) + 1
    assert notes[-1].startswith("The network bandwidth of g5.xlarge 10, g6.xlarge 10, g6e.xlarge 20, p3.2xlarge 10 Gbit/s is the "
                                "provider's 'up to' burst peak, not a sustained rate") and "--bandwidth-gbps" in notes[-1]
    # a bandwidth the user gives is no burst figure; the paper's table and a user CSV state theirs
    assert load_catalog("aws-2026", bandwidth_gbps=5).caveats() == cat.notes
    assert load_catalog("alicloud-2023").caveats() == ()
    # the mark is no figure: studies of aws-2026 made before it are of the same catalog
    unmarked = replace(cat, instances=tuple(replace(i, network_burst=False) for i in cat.instances))
    assert _catalog_fingerprint(cat) == _catalog_fingerprint(unmarked)


def test_unknown_catalog_lists_the_valid_names():
    with pytest.raises(CatalogError, match=r"Unknown catalog 'gcp-2025'.*HINT: Use one of alicloud-2023, aws-2026"):
        load_catalog("gcp-2025")
    with pytest.raises(CatalogError, match=r"not in catalog 'aws-2026'.*g5.xlarge"):
        BUILTIN_CATALOGS["aws-2026"].get("m5.large")


def test_a_catalog_path_that_is_a_directory_or_empty_says_so(tmp_path: Path):
    (tmp_path / "dir.csv").mkdir()
    with pytest.raises(CatalogError, match=r"dir.csv' is a directory, not a file.*HINT"):
        load_catalog(str(tmp_path / "dir.csv"))
    with pytest.raises(CatalogError, match=r"No catalog was named.*HINT"):  # not "'.' is a directory"
        load_catalog("")


def _write(tmp_path: Path, text: str, name: str = "cat.csv") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_skypilot_csv_parsed_by_header_name(tmp_path):
    # columns in SkyPilot's GCP-like order, plus NetworkGbps, a CPU-only row and a shared GPU
    path = _write(
        tmp_path,
        "AcceleratorName,InstanceType,Region,AcceleratorCount,vCPUs,MemoryGiB,Price,SpotPrice,NetworkGbps\n"
        "A100,a2-highgpu-1g,us-central1,1,12,85,3.67,1.1,24\n"
        "A100,a2-highgpu-1g,us-central1,1,12,85,3.50,1.1,24\n"
        ",n2-standard-8,us-central1,,8,32,0.38,0.1,16\n"
        "L4,g2-standard-4,us-central1,1,4,16,0.70,,16\n"
        "L4,g2-standard-4,europe-west4,1,4,16,0.77,,16\n"
        "T4,shared-t4,us-central1,1/2,4,16,0.20,,8\n",
    )
    cat = parse_catalog_csv(path)
    assert cat.currency == "USD"
    types = set(cat.instance_types)
    assert types == {"a2-highgpu-1g", "g2-standard-4@us-central1", "g2-standard-4@europe-west4", "shared-t4"}
    a2 = cat.get("a2-highgpu-1g")
    assert a2.gpu == "A100-40GB" and a2.price_per_hour == 3.50 and a2.spot_price_per_hour == 1.1  # cheapest AZ row kept
    assert a2.gpu_memory_gb == pytest.approx(40)
    shared = cat.get("shared-t4")
    assert shared.gpus_per_instance == 0.5 and shared.gpu_memory_gb == pytest.approx(8)
    assert "line 7" in shared.source


def test_rows_a_plan_cannot_use_are_skipped_with_one_warning(tmp_path):
    """A SkyPilot file lists GPUs the spec table does not know and instances without an on-demand price: those rows
    are skipped (one warning counts them and names one of each), the rest is the catalog. One such row refused the file."""
    path = _write(
        tmp_path,
        "InstanceType,AcceleratorName,AcceleratorCount,Price,NetworkGbps\n"
        "g5.xlarge,A10G,1,1.006,10\n"
        "p2.xlarge,K80,1,0.9,10\n"
        "inf2.xlarge,Inferentia2,1,0.76,15\n"
        "g4dn.xlarge,T4,1,,25\n",
    )
    with pytest.warns(UserWarning, match=r"2 rows skipped for unknown GPU, 1 row skipped for no price \(e.g. cat.csv line 3: unknown GPU 'K80' for 'p2.xlarge'; "
                                         r"cat.csv line 5: column 'Price' is empty for 'g4dn.xlarge'\); 1 row is used. For the GPUs: the spec table knows T4"):
        cat = parse_catalog_csv(path)
    assert cat.instance_types == ("g5.xlarge",)


def test_skypilots_gcp_file_with_accelerators_priced_alone_is_read(tmp_path):
    """SkyPilot's GCP catalog prices the GPUs (and TPUs) attached to an N1 host in rows without an InstanceType: those
    rows are skipped with the warning, not the whole file refused at the first of them."""
    path = _write(
        tmp_path,
        "InstanceType,vCPUs,MemoryGiB,AcceleratorName,AcceleratorCount,GpuInfo,Region,AvailabilityZone,Price,SpotPrice\n"
        "a2-highgpu-1g,12.0,85.0,,,,us-central1,us-central1-a,0.73948,0.29576\n"
        ",,,T4,1,T4,us-central1,us-central1-a,0.35,0.11\n"
        ",,,tpu-v5p-8,1,tpu-v5p-8,us-east5,us-east5-c,18547.2,9273.6\n"
        "g2-standard-4,4.0,16.0,L4,1.0,L4,us-central1,us-central1-a,0.70683,0.2827\n",
    )
    with pytest.warns(UserWarning, match=r"2 rows skipped for no instance type \(e.g. cat.csv line 3: accelerator 'T4' without an InstanceType\); 1 row is used"):
        cat = load_catalog(str(path), bandwidth_gbps=32)
    assert cat.instance_types == ("g2-standard-4",)
    only = _write(tmp_path, "InstanceType,AcceleratorName,AcceleratorCount,Price,NetworkGbps\n,T4,1,0.35,16\n", "only.csv")
    with pytest.raises(CatalogError, match=r"only.csv line 2: accelerator 'T4' without an InstanceType \(1 row skipped for no instance type, no usable row\).*HINT"):
        parse_catalog_csv(only)


def test_skypilots_v100_32gb_rows_are_searched_on_32_gb(tmp_path):
    """SkyPilot's AWS catalog names p3dn.24xlarge's GPU "V100-32GB": it was skipped as an unknown GPU (the 16 GB V100 row
    refuses a name with another size), so the search never saw the instance."""
    path = _write(tmp_path, "InstanceType,AcceleratorName,AcceleratorCount,Price,NetworkGbps\np3dn.24xlarge,V100-32GB,8,31.212,100\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing skipped
        inst = parse_catalog_csv(path).get("p3dn.24xlarge")
    assert inst.gpu == "V100-32GB" and inst.gpu_memory_gb == 32 and inst.gpu_spec().memory_bytes == 32 * 2**30
    assert inst.gpu_spec().fp32_flops == GPUS["V100"].fp32_flops and inst.gpu_spec().tf32_flops is None


def test_a_32_gb_pcie_v100_is_a_catalog_gpu_and_a_profiled_device(tmp_path):
    """torch's "Tesla V100-PCIE-32GB" had no row: a CSV row naming it was skipped as an unknown GPU, and a profile taken
    on one was refused by the tuner (its times could not be scaled to the catalog's GPUs)."""
    from tuner_profile_factory import make_profile

    from lightning_distplan.tuner import tune

    path = _write(tmp_path, "InstanceType,AcceleratorName,AcceleratorCount,Price,NetworkGbps\nv100pcie.x1,Tesla V100-PCIE-32GB,1,2.0,10\n"
                            "v100pcie.x4,V100-PCIe-32GB,4,8.0,10\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing skipped
        cat = parse_catalog_csv(path)
    for inst in cat.instances:
        assert inst.gpu == "V100-PCIe-32GB" and inst.gpu_memory_gb == 32 and inst.gpu_spec().memory_bytes == 32 * 2**30
        assert inst.gpu_spec().tensor_flops == GPUS["V100-PCIe"].tensor_flops and inst.gpu_spec().tf32_flops is None
    result = tune(make_profile(device_name="Tesla V100-PCIE-32GB"), catalog=cat, global_batch_size=64, n_trials=20, max_instances=2,
                  seed=0, storage=f"sqlite:///{tmp_path / 's.db'}", study_name="s", progress=False)
    assert result.best.feasible and result.best.instance_type in ("v100pcie.x1", "v100pcie.x4")
    # profiled on the very GPU it is priced on: no compute scaling
    assert result.projections["v100pcie.x1"]["compute_scale"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ("g5.xlarge,A10G,1,,10\n", r"cat.csv line 2: column 'Price' is empty for 'g5.xlarge' \(1 row skipped for no price, no usable row\).*HINT"),
        ("g5.xlarge,A10G,1,-1.0,10\n", r"cat.csv line 2: column 'Price' holds '-1.0'; it must be a number, zero or more.*HINT"),
        ("g5.xlarge,A10G,1,cheap,10\n", r"cat.csv line 2: column 'Price' holds 'cheap', which is not a number.*HINT"),
        ("x.large,TPUv5,1,2.0,10\ny.large,K80,1,,10\n",
         r"cat.csv line 2: unknown GPU 'TPUv5' for 'x.large' \(2 rows skipped for unknown GPU, no usable row\); the spec table knows T4, A10, A10G.*HINT"),
        ("g5.xlarge,A10G,two,1.0,10\n", r"line 2: column 'AcceleratorCount' holds 'two'"),
        ("g5.xlarge,A10G,1.5,1.0,10\n", r"line 2: .*1.5 GPUs per instance is neither whole nor a share"),
    ],
)
def test_bad_rows_name_the_line_and_the_rule(tmp_path, body, match):
    path = _write(tmp_path, "InstanceType,AcceleratorName,AcceleratorCount,Price,NetworkGbps\n" + body)
    with pytest.raises(CatalogError, match=match):
        parse_catalog_csv(path)


def test_an_unclosed_quote_names_its_line_and_loses_no_row_silently(tmp_path):
    """A quote opened and never closed swallowed every line after it into one cell: on the first data row the file was
    reported as having "no GPU instance rows"; on a later row that row was skipped for "no price" (a warning) and the
    rows after it vanished, the catalog loading with one instance of three."""
    header = "InstanceType,AcceleratorName,AcceleratorCount,Price,NetworkGbps\n"
    first = _write(tmp_path, header + '"g5.xlarge,A10G,1,1.0,10\ng5.2xlarge,A10G,1,1.2,10\n', name="first.csv")
    with pytest.raises(CatalogError, match=r"first.csv line 2: the row is not valid CSV \(a quote opened there is never closed\)\..*HINT"):
        parse_catalog_csv(first)
    later = _write(tmp_path, header + 'g5.xlarge,A10G,1,1.0,10\ng5.2xlarge,"A10G,1,1.2,10\ng5.4xlarge,A10G,1,1.6,10\n', name="later.csv")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "skipped for no price" warning before the error
        with pytest.raises(CatalogError, match=r"later.csv line 3: the row is not valid CSV \(a quote opened there is never closed\)"):
            parse_catalog_csv(later)
    # a quoted cell holding a line break is valid CSV: the rows after it keep their own line numbers
    spans = _write(tmp_path, header + '"g5.\nxlarge",A10G,1,1.0,10\ng5.2xlarge,A10G,1,cheap,10\n', name="spans.csv")
    with pytest.raises(CatalogError, match=r"spans.csv line 4: column 'Price' holds 'cheap'"):
        parse_catalog_csv(spans)


def test_a_space_after_a_closing_quote_is_read_as_before_the_unclosed_quote_check(tmp_path):
    """a00dfb7 read the whole file strictly to catch an unclosed quote, which also refused what csv (and spreadsheets) had
    read before: a space between a closing quote and the comma ('"g5.xlarge" ,A10G') gave "line 2: the row is not valid
    CSV (',' expected after '"')". Only a quote that is never closed is refused."""
    header = "InstanceType,AcceleratorName,AcceleratorCount,Price,NetworkGbps\n"
    padded = _write(tmp_path, header + '"g5.xlarge" ,A10G,1,1.0,10\ng5.2xlarge, "A10G" ,1,1.2,10\n', name="padded.csv")
    assert [(i.instance_type, i.gpu) for i in parse_catalog_csv(padded).instances] == [("g5.xlarge", "A10G"), ("g5.2xlarge", "A10G")]
    last = _write(tmp_path, header + 'g5.xlarge,A10G,1,1.0,10\n"g5.2xlarge,A10G,1,1.2,10\n\n', name="last.csv")
    with pytest.raises(CatalogError, match=r"last.csv line 3: the row is not valid CSV \(a quote opened there is never closed\)"):
        parse_catalog_csv(last)


def test_a_zero_price_loads_from_a_csv_as_an_instance_takes_it(tmp_path):
    """Instance(price_per_hour=0) is hardware you own (SkyPilot's on-prem vSphere catalog writes Price 0.0), but the CSV
    parser refused the same row: "column 'Price' holds '0'; it must be a positive number"."""
    from lightning_distplan.tuner.catalog import Instance

    path = _write(tmp_path, "InstanceType,AcceleratorName,AcceleratorCount,Price,SpotPrice,NetworkGbps\nown.4x,A10G,4,0.0,0,10\n"
                            "g5.xlarge,A10G,1,1.006,0.4,10\n")
    cat = parse_catalog_csv(path)
    assert [(i.instance_type, i.price_per_hour, i.spot_price_per_hour) for i in cat.instances] == [("own.4x", 0.0, 0.0), ("g5.xlarge", 1.006, 0.4)]
    assert spot_priced(cat).get("own.4x").price_per_hour == 0.0
    assert parse_catalog_csv(path, pricing="spot").get("own.4x").price_per_hour == 0.0
    assert Instance(instance_type="own", gpu="A10G", gpus_per_instance=1, gpu_memory_gb=24, vcpus=4, memory_gb=16, network_gbps=10,
                    price_per_hour=0.0, currency="USD").price_per_hour == 0.0
    with pytest.raises(CatalogError, match=r"`price_per_hour` must be a number, zero or more, got -1.0.*HINT"):
        Instance(instance_type="own", gpu="A10G", gpus_per_instance=1, gpu_memory_gb=24, vcpus=4, memory_gb=16, network_gbps=10,
                 price_per_hour=-1.0, currency="USD")


def test_a_pcie_instance_named_by_skypilots_bare_gpu_name_gets_the_pcie_row(tmp_path):
    """SkyPilot names both H100s "H100"; Lambda's gpu_1x_h100_pcie was priced on the H100 SXM row (989 TFLOP/s, 3.35 TB/s)
    where the card is the PCIe part (756 TFLOP/s, 2.0 TB/s). An instance type with the word pcie now picks the PCIe row."""
    path = _write(tmp_path, "InstanceType,AcceleratorName,AcceleratorCount,Price,NetworkGbps\n"
                            "gpu_1x_h100_pcie,H100,1,2.49,10\ngpu_8x_h100_sxm5,H100,8,23.92,100\np5.48xlarge,H100,8,98.32,3200\n"
                            "gpu_1x_a100_pcie,A100,1,1.29,10\nbig_a100-pcie,A100-80GB,1,1.8,10\nv100.pcie.x1,V100,1,1.0,10\n"
                            "own_pcie,H100-SXM,1,0,10\nx.pcie,L4,1,0.8,10\n")
    gpus = {i.instance_type: i.gpu for i in parse_catalog_csv(path).instances}
    assert gpus == {"gpu_1x_h100_pcie": "H100-PCIe", "gpu_8x_h100_sxm5": "H100-SXM", "p5.48xlarge": "H100-SXM",
                    "gpu_1x_a100_pcie": "A100-PCIe-40GB", "big_a100-pcie": "A100-PCIe-80GB", "v100.pcie.x1": "V100-PCIe",
                    "own_pcie": "H100-SXM",  # a part named outright is kept
                    "x.pcie": "L4"}
    pcie = parse_catalog_csv(path).get("gpu_1x_h100_pcie").gpu_spec()
    assert pcie.tensor_flops == GPUS["H100-PCIe"].tensor_flops == 756e12
    assert pcie.memory_bandwidth_bytes_per_s == GPUS["H100-PCIe"].memory_bandwidth_bytes_per_s


def test_missing_columns_and_bandwidth(tmp_path):
    path = _write(tmp_path, "InstanceType,AcceleratorName,AcceleratorCount,Price\ng5.xlarge,A10G,1,1.006\n")
    with pytest.raises(CatalogError, match=r"line 1: missing column\(s\) \['NetworkGbps'\].*HINT:.*--bandwidth"):
        load_catalog(str(path))
    cat = load_catalog(str(path), bandwidth_gbps=25)
    assert cat.get("g5.xlarge").network_gbps == 25 and "given" in cat.get("g5.xlarge").network_source
    bad = _write(tmp_path, "InstanceType,GPU,Price\nx,A10G,1\n", "bad.csv")
    with pytest.raises(CatalogError, match=r"missing column\(s\) \['AcceleratorName', 'AcceleratorCount', 'NetworkGbps'\]"):
        parse_catalog_csv(bad)
    with pytest.raises(CatalogError, match=r"does not exist.*alicloud-2023"):
        load_catalog(str(tmp_path / "nope.csv"))
    with pytest.raises(CatalogError, match=r"bandwidth must be a positive"):
        load_catalog("aws-2026", bandwidth_gbps=-3)


def test_gpu_memory_above_the_card_is_refused(tmp_path):
    # a typo (800 for 80) priced plans on memory the card does not have
    head = "InstanceType,AcceleratorName,AcceleratorCount,Price,NetworkGbps,GpuMemoryGiB\n"
    with pytest.raises(CatalogError, match=r"line 2: .*800 GiB of GPU memory per GPU is more than twice what the A100-80GB has "
                                          r"\(80 GiB, spec table\).*HINT: Give GpuMemoryGiB per GPU"):
        parse_catalog_csv(_write(tmp_path, head + "p4de.24xlarge,A100-80GB,8,40.0,400,800\n"))
    assert parse_catalog_csv(_write(tmp_path, head + "p4de.24xlarge,A100-80GB,8,40.0,400,80\n", "ok.csv")).get("p4de.24xlarge").gpu_memory_gb == 80
    # variants the spec table files under one row sell more than it: V100 32 GB (16 GB row), H100 NVL 94 GB (80 GB H100-PCIe row)
    more = parse_catalog_csv(_write(tmp_path, head + "p3dn.24xlarge,V100,8,31.2,100,32\nnc40,H100-NVL,1,6.98,40,94\n", "variants.csv"))
    assert (more.get("p3dn.24xlarge").gpu_memory_gb, more.get("nc40").gpu_memory_gb) == (32, 94)
    # a shared GPU sells part of the card
    assert parse_catalog_csv(_write(tmp_path, head + "v.large,A10,0.5,1.0,10,12\n", "half.csv")).get("v.large").gpu_memory_gb == 12


def test_a_shared_gpu_given_the_whole_cards_memory_is_refused(tmp_path):
    """A sixth of an A10 sells 4 GB (seed 000 Table III); its row written with the card's 24 ("per GPU") passed the
    whole-card check, and every plan on it was priced on 22.5 GiB of device memory instead of 3.75 (a plan that runs out of
    memory there predicted to fit)."""
    head = "InstanceType,AcceleratorName,AcceleratorCount,Price,NetworkGbps,GpuMemoryGiB\n"
    with pytest.raises(CatalogError, match=r"line 2: Instance 'vgn\.sixth': 24 GiB of GPU memory for its 1/6 share of the A10 is more than twice "
                                          r"that share of the card \(4 of 24 GiB, spec table\)\. HINT: For a shared GPU give GpuMemoryGiB of the "
                                          r"share \(e\.g\. 4\)"):
        parse_catalog_csv(_write(tmp_path, head + "vgn.sixth,A10,1/6,3.117,3,24\n"))
    sixth = parse_catalog_csv(_write(tmp_path, head + "vgn.sixth,A10,1/6,3.117,3,4\nsgn.twelfth,A10,1/12,1.875,5,\n", "ok.csv"))
    assert sixth.get("vgn.sixth").gpu_spec().memory_bytes == int(4 * 2**30 * 15 / 16)  # the share, less ECC's sixteenth
    assert sixth.get("sgn.twelfth").gpu_memory_gb == 2  # left empty: that share of the card
    from lightning_distplan.tuner.catalog import Instance

    with pytest.raises(CatalogError, match=r"for its 1/2 share of the T4 is more than twice"):
        Instance(instance_type="t", gpu="T4", gpus_per_instance=0.5, gpu_memory_gb=16.5, vcpus=4, memory_gb=16, network_gbps=5,
                 price_per_hour=1.0, currency="USD")


def test_bandwidth_override_applies_to_a_catalog_object_too(tmp_path):
    from tuner_profile_factory import make_profile

    from lightning_distplan.tuner import tune

    csv = _write(tmp_path, "InstanceType,AcceleratorName,AcceleratorCount,Price,NetworkGbps\ng6.xlarge,L4,1,0.8,100\n")
    best = {}
    for key, catalog, gbps in (("path", str(csv), 0.01), ("object", load_catalog(str(csv)), 0.01), ("plain", load_catalog(str(csv)), None)):
        best[key] = tune(make_profile(), catalog=catalog, global_batch_size=64, n_trials=30, max_instances=4, bandwidth_gbps=gbps, seed=0,
                         time_weight=1e9, storage=f"sqlite:///{tmp_path / key}.db", study_name="s", progress=False).best
    # fastest at 100 Gbit/s: several instances; at 0.01 Gbit/s the all-reduce makes one the fastest. A Catalog object
    # used to keep its 100 Gbit/s whatever bandwidth_gbps said.
    assert best["plain"].count > 1
    assert best["object"].count == best["path"].count == 1
    assert best["object"].step_time_s == best["path"].step_time_s


def test_mixed_currencies_are_refused(tmp_path):
    path = _write(
        tmp_path,
        "InstanceType,AcceleratorName,AcceleratorCount,Price,NetworkGbps,Currency\na,T4,1,1,10,USD\nb,T4,1,1,10,EUR\n",
    )
    with pytest.raises(CatalogError, match=r"mixes currencies \['EUR', 'USD'\]"):
        parse_catalog_csv(path)


_SPOT_CSV = (
    "InstanceType,AcceleratorName,AcceleratorCount,Price,SpotPrice,NetworkGbps\n"
    "g6.xlarge,L4,1,0.80,0.30,10\n"
    "g5.xlarge,A10G,1,1.00,0.25,10\n"
    "g5.xlarge,A10G,1,1.10,0.20,10\n"  # another zone: cheaper at spot, dearer on demand
    "p3.2xlarge,V100,1,3.06,,10\n"  # no spot price
)


def test_spot_pricing_prices_each_instance_at_its_spot_price(tmp_path):
    path = _write(tmp_path, _SPOT_CSV)
    demand = load_catalog(str(path))
    assert demand.pricing == "on-demand" and demand.name == "cat"
    assert {i.instance_type: i.price_per_hour for i in demand.instances} == {"g6.xlarge": 0.80, "g5.xlarge": 1.00, "p3.2xlarge": 3.06}
    with pytest.warns(UserWarning, match=r"1 row skipped for no spot price \(e.g. cat.csv line 5: column 'SpotPrice' is empty for 'p3.2xlarge'\)"):
        spot = load_catalog(str(path), pricing="spot")
    assert spot.pricing == "spot" and spot.name == "cat-spot"  # a study of it is not the on-demand one's
    # the cheapest zone at spot prices, not the row cheapest on demand
    assert {i.instance_type: i.price_per_hour for i in spot.instances} == {"g6.xlarge": 0.30, "g5.xlarge": 0.20}
    # the same from a Catalog object: instances without a spot price are left out with a warning naming them
    with pytest.warns(UserWarning, match=r"Catalog cat: 1 instance type without a spot price left out \(p3.2xlarge\); 2 searched at spot prices"):
        again = spot_priced(demand)
    assert again.name == "cat-spot" and {i.instance_type: i.price_per_hour for i in again.instances} == {"g6.xlarge": 0.30, "g5.xlarge": 0.25}
    assert spot_priced(again) is again


def test_spot_pricing_needs_spot_prices_and_not_the_on_demand_column(tmp_path):
    only_spot = _write(tmp_path, "InstanceType,AcceleratorName,AcceleratorCount,SpotPrice,NetworkGbps\ng6.xlarge,L4,1,0.3,10\n", "spot.csv")
    assert load_catalog(str(only_spot), pricing="spot").get("g6.xlarge").price_per_hour == 0.3
    with pytest.raises(CatalogError, match=r"missing column\(s\) \['Price'\]"):
        load_catalog(str(only_spot))
    no_spot = _write(tmp_path, "InstanceType,AcceleratorName,AcceleratorCount,Price,NetworkGbps\ng6.xlarge,L4,1,0.8,10\n", "demand.csv")
    with pytest.raises(CatalogError, match=r"missing column\(s\) \['SpotPrice'\]"):
        load_catalog(str(no_spot), pricing="spot")
    empty_spot = _write(tmp_path, "InstanceType,AcceleratorName,AcceleratorCount,Price,SpotPrice,NetworkGbps\ng6.xlarge,L4,1,0.8,,10\n", "e.csv")
    with pytest.raises(CatalogError, match=r"column 'SpotPrice' is empty for 'g6.xlarge' \(1 row skipped for no spot price, no usable row\).*HINT: Fill in SpotPrice"):
        load_catalog(str(empty_spot), pricing="spot")
    for name in BUILTIN_CATALOGS:
        with pytest.raises(CatalogError, match=rf"Catalog '{name}' has no spot prices \(the built-in catalogs list on-demand prices only\).*HINT"):
            load_catalog(name, pricing="spot")
    with pytest.raises(CatalogError, match=r"Unknown pricing 'reserved'.*HINT: Use one of on-demand, spot"):
        load_catalog("aws-2026", pricing="reserved")


def test_a_spot_search_minimises_the_spot_cost(tmp_path):
    from tuner_profile_factory import make_profile

    from lightning_distplan.tuner import exhaustive, tune

    # two instance types alike but for their prices: the cheaper one on demand is the dearer one at spot
    path = _write(tmp_path, "InstanceType,AcceleratorName,AcceleratorCount,Price,SpotPrice,NetworkGbps\n"
                            "a.xlarge,L4,1,0.80,0.60,10\nb.xlarge,L4,1,0.90,0.20,10\n")
    profile = make_profile()
    best, names = {}, {}
    for pricing in ("on-demand", "spot"):
        result = tune(profile, catalog=str(path), global_batch_size=64, n_trials=30, max_instances=2, pricing=pricing, seed=0,
                      storage=f"sqlite:///{tmp_path / 's.db'}", progress=False)
        best[pricing], names[pricing] = result.best, result.study_name
        assert result.pricing == result.to_dict()["pricing"] == pricing
        price = {"on-demand": {"a.xlarge": 0.80, "b.xlarge": 0.90}, "spot": {"a.xlarge": 0.60, "b.xlarge": 0.20}}[pricing][result.best.instance_type]
        assert result.best.cost_per_step == pytest.approx(result.best.count * price / 3600 * result.best.step_time_s)
        optimum = exhaustive(profile, str(path), global_batch_size=64, max_instances=2, pricing=pricing).best
        assert (result.best.instance_type, result.best.count, result.best.plan, result.best.objective) == (
            optimum.instance_type, optimum.count, optimum.plan, optimum.objective)
    assert (best["on-demand"].instance_type, best["spot"].instance_type) == ("a.xlarge", "b.xlarge")
    assert names == {"on-demand": "distplan-cat-B64-w0", "spot": "distplan-cat-spot-B64-w0"}  # two studies, side by side in one file
    # a Catalog already spot-priced is searched as it is; asking it for on-demand prices is refused
    spot = load_catalog(str(path), pricing="spot")
    with pytest.raises(CatalogError, match=r"priced at spot prices, and on-demand pricing was asked for.*HINT"):
        tune(profile, catalog=spot, global_batch_size=64, n_trials=5, pricing="on-demand", storage=f"sqlite:///{tmp_path / 'x.db'}", progress=False)
