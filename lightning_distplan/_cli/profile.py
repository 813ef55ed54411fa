"""``distplan profile package.module:ClassName --out P``: profile a LightningModule and write its Profile JSON."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import os
import sys
import time
from typing import Any

from lightning_distplan._files import check_output_path, check_replaceable
from lightning_distplan._format import format_ms
from lightning_distplan.errors import DataLoadingError, DistPlanError, ProfilingError, first_line
from lightning_distplan.profile import PRECISIONS

__all__ = ["add_parser", "run"]

_DEMO_HINT = (
    "For Lightning's demo Transformer use --datamodule lightning_distplan.demos:RandomTokenData; "
    "for image classifiers --datamodule lightning_distplan.demos:RandomImageData."
)


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "profile",
        help="profile a LightningModule on this machine and write the Profile JSON",
        description=(
            "Build the LightningModule, take real batches from its train_dataloader() (or --datamodule's), "
            "measure per-layer time, memory and FLOPs on CUDA when present else CPU, and write the Profile JSON."
        ),
    )
    parser.add_argument("model", metavar="package.module:ClassName",
                        help="import path of the LightningModule class (modules in the current folder import, as under python -m)")
    parser.add_argument("--out", required=True, help="where to write the Profile JSON")
    parser.add_argument("--init-args", default="{}", metavar="JSON", help="keyword arguments for the model's constructor")
    parser.add_argument("--datamodule", default=None, metavar="package.module:ClassName", help="LightningDataModule class giving the batches")
    parser.add_argument("--datamodule-args", default="{}", metavar="JSON", help="keyword arguments for the datamodule's constructor")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="device to profile on (default: cuda when present)")
    parser.add_argument("--micro-batch-sizes", default=None, metavar="M1,M2,...", help="sizes to time (default: b/2, b, 2b, 4b of the loader's batch size b, each only while its step is predicted under "
        "1.5 s, then smaller ones (b/4, b/8, ...) until three sizes are timed)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per size at least; a short whole step is repeated until its runs add up to 0.25 s "
                        "(at most 100 runs), and keeps their mean (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per size before the timed ones (default 1)")
    parser.add_argument(
        "--precision", default="32-true", choices=PRECISIONS,
        help="the Trainer precision the steps run in, as Trainer(precision=...) (default 32-true)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.set_defaults(run=run)


def _load_class(path: str, *, what: str, option: str) -> type:
    if ":" not in path and path.endswith(".py"):  # a file, and no class: mymodel.py
        stem = os.path.basename(path).removesuffix(".py") or "mymodule"
        raise ProfilingError(
            f"{what} path {path!r} names a file, not a module and class to import.",
            hint=f"Name the module as Python imports it and the class after a colon: {option}{stem}:ClassName.",
        )
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ProfilingError(f"{what} path {path!r} is not of the form package.module:ClassName.", hint=f"Pass e.g. {option}lightning.pytorch.demos.transformer:LightningTransformer.")
    if module_name.startswith(".") or module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
        # a file path (mymods.py:Tiny, ./mymods.py:Tiny) or a relative import: importlib would say 'No module named
        # mymods.py' or ask for a package; the module's import name is what is wanted
        parts = [part for part in module_name.removesuffix(".py").replace(os.sep, "/").split("/") if part not in ("", ".")]
        name = parts[-1].lstrip(".") if ".." in parts or os.path.isabs(module_name) else ".".join(parts).lstrip(".")
        found = "names a file, not a module to import" if module_name.endswith(".py") or "/" in module_name or os.sep in module_name \
            else "is a relative module name; the module is imported by its absolute name"
        raise ProfilingError(
            f"{what} path {path!r} {found}.",
            hint=f"Name the module as Python imports it, from the folder that holds it: {option}{name or 'mymodule'}:{attr}.",
        )
    # The console script's sys.path[0] is its own folder: put the current one first, as `python -m` does, so a model
    # in the folder the command runs from imports (uvicorn and flask do the same).
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and err.name != module_name and not module_name.startswith(err.name + "."):
            # the module was found, but something it imports is not: another package, or a part of its own
            package = module_name.split(".")[0]
            if err.name.split(".")[0] == package:
                raise ProfilingError(
                    f"Importing module {module_name!r} for {what} {path!r} failed: it imports {err.name!r}, which its package "
                    f"{package!r} does not have ({reason(err)}).",
                    hint=f"Check that import in {module_name!r} (a misspelt module of your own?).",
                ) from err
            raise ProfilingError(
                f"Importing module {module_name!r} for {what} {path!r} failed: it imports {err.name!r}, which is not installed ({reason(err)}).",
                hint=f"Install the package that provides {err.name!r} in this environment, or put it on PYTHONPATH.",
            ) from err
        if err.name is None:  # raised by the module's own code, naming no module
            raise ProfilingError(
                f"Importing module {module_name!r} for {what} {path!r} failed while running its code: ModuleNotFoundError: {reason(err)}.",
                hint=f"Fix the error in that module; `python -c 'import {module_name}'` shows its traceback.",
            ) from err
        raise ProfilingError(
            f"Cannot import module {module_name!r} for {what} {path!r} ({err}).",
            hint="Check the spelling and that the package is installed in this environment (or on PYTHONPATH).",
        ) from None
    except (Exception, SystemExit) as err:  # the module's own code failed while it was imported (not a Ctrl-C)
        found = f"called sys.exit({err.code!r})" if isinstance(err, SystemExit) else f"{type(err).__name__}: {reason(err)}"
        raise ProfilingError(
            f"Importing module {module_name!r} for {what} {path!r} failed while running its code: {found}"
            + ("" if found.endswith((".", "!", "?")) else "."),
            hint=f"Fix the error in that module; `python -c 'import {module_name}'` shows its traceback.",
        ) from err
    if ":" not in path and _is_module(path):  # a dotted path naming a module (imported or not)
        raise ProfilingError(f"{what} path {path!r} names a module, not a class.", hint=f"Add the class after a colon: {option}{path}:ClassName.")
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            classes = {n: c for n in dir(module) if not n.startswith("_") and isinstance(c := getattr(module, n, None), type)}
            # the classes the module defines, not those it imports (DataLoader, Tensor, typing.Any); a package that only
            # re-exports its classes defines none: then every class it holds
            defined = sorted(n for n, c in classes.items() if getattr(c, "__module__", None) == module.__name__)
            listed, which = (defined, "Classes it defines") if defined else (sorted(classes), "Classes it holds")
            raise ProfilingError(
                f"Module {module_name!r} has no attribute {attr!r}.",
                hint=f"{which}: {', '.join(listed[:20]) or '(none)'}.",
            )
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise ProfilingError(f"{path!r} is a {type(obj).__name__}, not a class.", hint=f"Name the {what} class itself.")
    return obj


def reason(err: BaseException) -> str:
    """The first line of ``err``'s message without a HINT of its own (ours follows it: one HINT per error)."""
    first = first_line(err) if str(err).strip() else "(no message)"
    return first.split(" HINT:")[0]


def _is_module(path: str) -> bool:
    try:
        return importlib.util.find_spec(path) is not None
    except (ImportError, ValueError):  # a parent that is a module, not a package
        return False


def _json_kwargs(text: str, option: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise ProfilingError(f"{option} {text!r} is not valid JSON ({err.msg} at position {err.pos}).", hint=f"Quote it for the shell, e.g. {option} '{{\"vocab_size\": 1000}}'.") from None
    if not isinstance(value, dict):
        raise ProfilingError(f"{option} must be a JSON object of keyword arguments, got a JSON {type(value).__name__}.", hint=f"Use e.g. {option} '{{\"vocab_size\": 1000}}'.")
    return value


def _sizes(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        sizes = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        sizes = []
    if not sizes or any(m < 1 for m in sizes):
        raise ProfilingError(f"--micro-batch-sizes {text!r} must be comma-separated positive integers.", hint="Use e.g. --micro-batch-sizes 2,4,8,16.")
    if len(set(sizes)) < 2:
        raise ProfilingError(
            f"--micro-batch-sizes {text!r} names one size; the time and memory lines need two or more (three to check they are lines).",
            hint="Use e.g. --micro-batch-sizes 2,4,8.",
        )
    return sizes


def build_error(what: str, path: str, kwargs: dict[str, Any], err: Exception, option: str) -> ProfilingError:
    """The one sentence for a constructor that refused ``kwargs``."""
    why = reason(err).rstrip(".") if str(err).strip() else ""
    return ProfilingError(
        f"Building {what} {path} with {kwargs!r} failed: {type(err).__name__}{': ' + why if why else ''}.",
        hint=f"Pass the constructor's required arguments with {option} JSON.",
    )


def _build(cls: type, kwargs: dict[str, Any], what: str, path: str, option: str) -> Any:
    try:
        return cls(**kwargs)
    except DistPlanError:
        raise
    except Exception as err:
        raise build_error(what, path, kwargs, err, option) from None


def run(args: argparse.Namespace) -> int:
    start = time.perf_counter()
    from lightning.pytorch import LightningDataModule, LightningModule

    from lightning_distplan.profiling import profile_module
    from lightning_distplan.profiling._device import resolve_device
    from lightning_distplan.profiling._precision import precision_plugin

    device = resolve_device(args.device)  # fail fast on --device cuda without a GPU
    check_output_path(args.out, "--out", example="profile.json")  # before profiling, not after
    check_replaceable(args.out, "--out", what="profile JSON", is_ours=lambda d: isinstance(d, dict) and "schema_version" in d and "layers" in d)
    sizes = _sizes(args.micro_batch_sizes)
    if args.repeats < 1 or args.warmup < 0:
        raise ProfilingError(f"--repeats ({args.repeats}) must be >= 1 and --warmup ({args.warmup}) >= 0.", hint="Use e.g. --repeats 3 --warmup 1.")
    init_args = _json_kwargs(args.init_args, "--init-args")
    dm_args = _json_kwargs(args.datamodule_args, "--datamodule-args")
    cls = _load_class(args.model, what="model", option="")
    if not issubclass(cls, LightningModule):
        raise ProfilingError(f"{args.model} is not a LightningModule (it is a subclass of {', '.join(b.__name__ for b in cls.__mro__[1:3])}).", hint="Name a lightning.pytorch.LightningModule subclass.")
    datamodule = None
    if args.datamodule:
        dm_cls = _load_class(args.datamodule, what="datamodule", option="--datamodule ")
        if not issubclass(dm_cls, LightningDataModule):
            raise ProfilingError(f"{args.datamodule} is not a LightningDataModule.", hint="Name a lightning.pytorch.LightningDataModule subclass.")
        datamodule = _build(dm_cls, dm_args, "datamodule", args.datamodule, "--datamodule-args")
    elif args.datamodule_args != "{}":
        raise ProfilingError("--datamodule-args was given without --datamodule.", hint="Add --datamodule package.module:ClassName.")
    model = _build(cls, init_args, "model", args.model, "--init-args")
    say = (lambda line: None) if args.quiet else (lambda line: print(line, flush=True))

    loader = train_loader(model, datamodule, model_path=args.model, datamodule_path=args.datamodule)
    precision = precision_plugin(args.precision, device)
    model = precision.convert_module(model)  # the weights' dtype for the '*-true' precisions, as the Trainer converts them
    try:
        profile = profile_module(
            model, loader, micro_batch_sizes=sizes, device=device, warmup=args.warmup, repeats=args.repeats,
            measure_links=False, progress=say, precision_plugin=precision, datamodule=datamodule,
        )
    except DataLoadingError as err:
        raise DataLoadingError(str(err).split(" HINT:")[0], hint=_data_hint(err.__cause__ or err)) from None
    profile = dataclasses.replace(profile, model=args.model if ":" in args.model else profile.model)
    path = profile.save(args.out)
    total = time.perf_counter() - start
    try:
        _summary(profile, path, total)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"the profile was written to {path}") from None  # main says what was kept
    return 0


def _data_hint(err: BaseException) -> str:
    """The HINT for data that did not load: a download that failed gets the offline way round, anything else where to look."""
    import urllib.error

    text = f"{type(err).__name__} {err}".lower()
    network = isinstance(err, (urllib.error.URLError, ConnectionError, TimeoutError)) or any(
        word in text for word in ("download", "resolve", "name or service", "network is unreachable", "connection", "'requests'"))
    if network:
        return "The data may need a download, which failed or was not allowed here. " + _DEMO_HINT
    return "Check that the model's or datamodule's train_dataloader() works outside a Trainer, or profile on random data. " + _DEMO_HINT


def _inherits_train_dataloader(model: Any) -> bool:
    """Whether ``model``'s ``train_dataloader`` is Lightning's stub (no class of the user's defines one)."""
    from lightning.pytorch.core.hooks import DataHooks

    own = getattr(type(model), "train_dataloader", None)
    return own is DataHooks.train_dataloader and "train_dataloader" not in vars(model)


def train_loader(model: Any, datamodule: Any, *, model_path: str, datamodule_path: str | None) -> Any:
    """The train loader of ``datamodule`` (or of ``model``), in Lightning's order; a failure is one :class:`DataLoadingError`.

    ``model`` may be None with a datamodule: its hooks are then not run (``distplan bench`` builds
    a fresh module per plan).
    """
    if datamodule is None and model is not None and _inherits_train_dataloader(model):
        # Lightning's stub raises "`train_dataloader` must be implemented", which the HINT below took for a loader that broke
        raise DataLoadingError(
            f"{model_path} defines no train_dataloader() and no --datamodule was given, so there are no batches to profile.",
            hint="Pass --datamodule package.module:ClassName (for lightning_distplan.bench.models:WideMLP, "
            "--datamodule lightning_distplan.bench.models:RandomVectorData). " + _DEMO_HINT,
        )
    # Lightning's order in fit(): prepare_data, setup("fit") (datamodule, then model), configure_model.
    # The model's own prepare_data is skipped when a datamodule supplies the data: it usually downloads
    # the very dataset the datamodule replaces (the demo Transformer's WikiText2).
    try:
        if datamodule is not None:
            datamodule.prepare_data()
            datamodule.setup("fit")
        else:
            model.prepare_data()
        if model is not None:
            model.setup("fit")
            model.configure_model()
        loader = datamodule.train_dataloader() if datamodule is not None else model.train_dataloader()
    except DistPlanError:
        raise
    except Exception as err:
        source = datamodule_path or f"{model_path}.train_dataloader()"
        first = reason(err)  # one HINT per error: ours, which names the way around the download
        raise DataLoadingError(
            f"Getting the training data from {source} failed with {type(err).__name__}: {first}" + ("" if first.endswith((".", "!", "?")) else "."),
            hint=_data_hint(err),
        ) from None
    if loader is None:
        raise DataLoadingError(f"{datamodule_path or model_path} returned no train_dataloader().", hint=_DEMO_HINT)
    from lightning_distplan.profiling._batches import refuse_several_loaders  # torch: not imported by `distplan plan`'s parser

    refuse_several_loaders(
        loader, source=f"{datamodule_path or model_path}.train_dataloader() returns",
        hint=f"Return one DataLoader from {datamodule_path or model_path}.train_dataloader(), or pass --datamodule with one.",
    )
    return loader


def _summary(profile: Any, path: Any, total: float) -> None:
    step = profile.step
    mem = profile.memory
    print(f"profile of {profile.model} on {profile.device.type} ({profile.device.name}) written to {path}")
    print(f"  micro-batch sizes {list(profile.micro_batch_sizes)}" + (f", out of memory at {list(profile.infeasible_micro_batch_sizes)}" if profile.infeasible_micro_batch_sizes else ""))
    # format_ms: a tiny model's per-sample time under 0.5 µs printed "0.000 ms·m" with 3 fixed decimals
    for name, fit in (("forward ", step.forward), ("backward", step.backward)):
        print(f"  step {name} t(m) = {format_ms(fit.alpha, 3)} ms·m + {format_ms(fit.beta, 3)} ms  (R² {fit.r2:.3f})")
    print(f"  {len(profile.layers)} layers, {'splittable' if profile.splittable else 'not splittable'} into pipeline stages")
    print(
        f"  memory: params {mem.param_bytes / 2**20:.1f} MiB, grads {mem.grad_bytes / 2**20:.1f} MiB, "
        f"{profile.optimizer.name} state {mem.optimizer_state_bytes / 2**20:.1f} MiB, activations {mem.activation.alpha / 2**20:.2f} MiB/sample"
    )
    if profile.unused_parameters:
        from lightning_distplan.strategies.dp_ga import few_names

        print(f"  unused: the loss gives no gradient to {few_names(profile.unused_parameters)}; data parallel training needs "
              "find_unused_parameters=True (auto_plan and distplan bench set it)")
    print(f"  time: profiling {profile.profiling_time_s:.1f} s, total {total:.1f} s")
