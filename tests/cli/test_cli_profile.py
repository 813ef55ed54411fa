"""`distplan profile`: a real run writes a loadable Profile; bad input exits 2 with one line and a HINT."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
import torch

from lightning_distplan.cli import main
from lightning_distplan.profile import Profile

torch.set_num_threads(1)

_TINY = ["--datamodule", "lightning_distplan.demos:RandomTokenData"]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(["profile", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_profile_demo_transformer_writes_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "p.json"
    rc, out, err = _run(
        [
            "lightning.pytorch.demos.transformer:LightningTransformer",
            "--init-args", json.dumps({"vocab_size": 64}),
            *_TINY, "--datamodule-args", json.dumps({"vocab_size": 64, "block_size": 8, "batch_size": 2, "num_samples": 16}),
            "--micro-batch-sizes", "1,2,4", "--repeats", "1", "--device", "cpu", "--out", str(out_file),
        ],
        capsys,
    )
    assert rc == 0, err
    profile = Profile.load(out_file)
    assert profile.model == "lightning.pytorch.demos.transformer:LightningTransformer"
    assert profile.micro_batch_sizes == (1, 2, 4)
    assert profile.splittable and len(profile.layers) >= 5
    # the head projects 200 -> 64 for 8 tokens per sample: 2*200*64*8 forward FLOPs (+ the loss)
    assert profile.layers[-1].flops_forward_per_sample >= 2 * 200 * 64 * 8
    assert "written to" in out and "R²" in out and "time: profiling" in out


@pytest.mark.parametrize(("precision", "dtype", "projects"), [("bf16-mixed", "bf16-mixed", True), ("bf16-true", "bfloat16", True), ("64-true", "float64", False)])
def test_profile_precision_is_recorded_and_tune_projects_only_32_or_16_bit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], precision: str, dtype: str, projects: bool
) -> None:
    out_file = tmp_path / "p.json"
    rc, _, err = _run(
        [
            "lightning.pytorch.demos.transformer:LightningTransformer", "--init-args", json.dumps({"vocab_size": 32}),
            *_TINY, "--datamodule-args", json.dumps({"vocab_size": 32, "block_size": 4, "batch_size": 2, "num_samples": 8}),
            "--micro-batch-sizes", "1,2", "--repeats", "1", "--device", "cpu", "--precision", precision, "--out", str(out_file),
        ],
        capsys,
    )
    assert rc == 0, err
    assert Profile.load(out_file).device.dtype == dtype
    rc = main(["tune", "--profile", str(out_file), "--global-batch-size", "8", "--trials", "3", "--quiet", "--max-instances", "2",
               "--storage", f"sqlite:///{tmp_path / 't.db'}"])
    err = capsys.readouterr().err
    if projects:
        assert rc == 0, err
    else:
        assert rc == 2 and "measured in float64; projecting to catalog GPUs assumes float32 or 16-bit math" in err and "HINT:" in err


def _write_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "cli_profile_fixtures.py").write_text(
        textwrap.dedent(
            """
            import torch
            from lightning.pytorch import LightningModule
            from torch.utils.data import DataLoader

            class NoParams(LightningModule):
                def training_step(self, batch, batch_idx):
                    return batch.sum()
                def train_dataloader(self):
                    return DataLoader(torch.ones(8, 2), batch_size=2)

            class NeedsDownload(LightningModule):
                def __init__(self):
                    super().__init__()
                    self.lin = torch.nn.Linear(2, 1)
                def training_step(self, batch, batch_idx):
                    return self.lin(batch).sum()
                def train_dataloader(self):
                    raise ConnectionError("Failed to resolve 'raw.githubusercontent.com'")

            class NeedsRequests(NeedsDownload):
                def train_dataloader(self):  # what Lightning's own demo raises without `requests`
                    raise ModuleNotFoundError("Requirement 'requests' not met. HINT: Try running `pip install -U 'requests'`")

            class NoLoader(NeedsDownload):
                def train_dataloader(self):  # not a download: the hint must not blame one
                    raise RuntimeError("no data here")

            class NotAModule:
                pass

            class TwoLoaders(NeedsDownload):
                def train_dataloader(self):  # Lightning combines them: training_step gets {"a": batch, "b": batch}
                    return {"a": DataLoader(torch.ones(8, 2), batch_size=2), "b": DataLoader(torch.ones(8, 2), batch_size=2)}
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))


def test_a_missing_class_hint_lists_the_classes_the_module_defines_not_those_it_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_module(tmp_path, monkeypatch)  # it imports LightningModule and DataLoader
    rc, _, err = _run(["cli_profile_fixtures:Missing", "--out", str(tmp_path / "p.json")], capsys)
    hint = err.split("HINT:")[1]
    assert rc == 2 and "NeedsDownload" in hint and "NoParams" in hint
    assert "DataLoader" not in hint and "LightningModule" not in hint


@pytest.mark.parametrize(
    ("argv", "pattern"),
    [
        (["no_such_pkg.models:Net"], r"Cannot import module 'no_such_pkg.models'"),
        (["cli_profile_fixtures:Missing"], r"has no attribute 'Missing'.*HINT: Classes it defines: .*NeedsDownload"),
        (["cli_profile_fixtures:NotAModule"], r"is not a LightningModule"),
        (["lightning_distplan.demos"], r"model path 'lightning_distplan.demos' names a module, not a class.*HINT: .*lightning_distplan.demos:ClassName"),
        (["cli_profile_fixtures:NeedsRequests"], r"Requirement 'requests' not met\. HINT: The data may need a download"),
        (["cli_profile_fixtures:NoLoader"], r"RuntimeError: no data here\. HINT: Check that the model's or datamodule's train_dataloader\(\) works outside a Trainer"),
        (["cli_profile_fixtures:NoParams"], r"no trainable parameters"),
        # a model with no train_dataloader() of its own and no --datamodule: Lightning's stub raised "`train_dataloader` must be
        # implemented", which the HINT took for a loader that failed ("check that it works outside a Trainer")
        (["lightning_distplan.bench.models:WideMLP"], r"^distplan profile: error: lightning_distplan\.bench\.models:WideMLP defines no train_dataloader\(\) "
         r"and no --datamodule was given, so there are no batches to profile\. HINT: Pass --datamodule .*lightning_distplan\.bench\.models:RandomVectorData"),
        (["cli_profile_fixtures:NeedsDownload"], r"ConnectionError.*HINT: .*--datamodule lightning_distplan.demos:RandomTokenData"),
        (["cli_profile_fixtures:NoParams", "--init-args", "{bad json"], r"--init-args .* is not valid JSON"),
        (["cli_profile_fixtures:NoParams", "--init-args", "[1, 2]"], r"must be a JSON object"),
        (["cli_profile_fixtures:NoParams", "--micro-batch-sizes", "2,x"], r"--micro-batch-sizes"),
        (["cli_profile_fixtures:NoParams", "--micro-batch-sizes", "4,4"], r"names one size; the time and memory lines need two or more"),
        (["cli_profile_fixtures:NoParams", "--datamodule", "cli_profile_fixtures:NotAModule"], r"is not a LightningDataModule"),
        (["cli_profile_fixtures.py:NoParams"], r"model path 'cli_profile_fixtures\.py:NoParams' names a file, not a module to import\. HINT: .*: cli_profile_fixtures:NoParams\.$"),
        (["./cli_profile_fixtures.py:NoParams"], r"names a file, not a module to import\. HINT: .*: cli_profile_fixtures:NoParams\.$"),
        (["cli_profile_fixtures.py"], r"model path 'cli_profile_fixtures\.py' names a file, not a module and class to import\. HINT: .*: cli_profile_fixtures:ClassName\.$"),
        (["sub/cli_profile_fixtures.py:NoParams"], r"names a file, not a module to import\. HINT: .*: sub\.cli_profile_fixtures:NoParams\.$"),
        ([".cli_profile_fixtures:NoParams"], r"is a relative module name; the module is imported by its absolute name\. HINT: .*: cli_profile_fixtures:NoParams\.$"),
        # the constructor's own HINT gives way to ours: one HINT per line
        (["cli_profile_fixtures:NoParams", "--datamodule", "lightning_distplan.bench.models:RandomVectorData", "--datamodule-args", '{"in_features": 0}'],
         r"Building datamodule .*RandomVectorData with \{'in_features': 0\} failed: ValueError: `in_features` \(0\) must be a positive integer\. HINT: Pass"),
        (["cli_profile_fixtures:TwoLoaders"], r"cli_profile_fixtures:TwoLoaders.train_dataloader\(\) returns a dict of train dataloaders, and planning profiles one train loader .*"
                                              r"HINT: Return one DataLoader from cli_profile_fixtures:TwoLoaders\.train_dataloader\(\)"),
    ],
)
def test_errors_exit_2_with_hint(
    argv: list[str], pattern: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_module(tmp_path, monkeypatch)
    rc, out, err = _run([*argv, "--out", str(tmp_path / "p.json")], capsys)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].count("HINT:") == 1 and "Traceback" not in err
    import re

    assert re.search(pattern, lines[0]), lines[0]
    assert not (tmp_path / "p.json").exists()


def test_cuda_without_gpu_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    rc, _, err = _run(["lightning.pytorch.demos.transformer:LightningTransformer", *_TINY, "--device", "cuda", "--out", str(tmp_path / "p.json")], capsys)
    assert rc == 2
    assert "no CUDA GPU" in err and "HINT:" in err


def test_output_paths_are_checked_before_the_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """profile --out and bench --out / --plot naming a folder (or a path under a file) fail at once, with nothing written."""
    (tmp_path / "file").write_text("mine")
    for argv, pattern in (
        (["profile", "no_such_pkg.models:Net", "--out", str(tmp_path)], r"--out '.*' is a directory\. HINT:"),
        (["bench", "no_such_pkg.models:Net", "--world-size", "1", "--global-batch-size", "4", "--out", str(tmp_path)], r"--out '.*' is a directory\. HINT:"),
        (["bench", "no_such_pkg.models:Net", "--world-size", "1", "--global-batch-size", "4", "--plot", str(tmp_path / "file" / "p.png")],
         r"--plot '.*' lies under '.*file', which is a file\. HINT:"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert re.search(pattern, err) and "Cannot import" not in err, err  # refused before the model was even imported
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"] and (tmp_path / "file").read_text() == "mine"


@pytest.mark.parametrize("name", ["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "64-true"])
def test_profile_precision_plugin_is_the_trainers(name):
    """``--precision`` profiles in the plugin a CPU Trainer runs ('16-mixed' becomes 'bf16-mixed' there, as Lightning does)."""
    import lightning as L
    import torch

    from lightning_distplan.profiling._precision import precision_plugin

    trainer = L.Trainer(accelerator="cpu", precision=name, logger=False, enable_progress_bar=False)
    ours = precision_plugin(name, torch.device("cpu"))
    assert type(ours) is type(trainer.precision_plugin)
    assert getattr(ours, "precision", None) == getattr(trainer.precision_plugin, "precision", None)


@pytest.mark.parametrize(
    ("source", "found"),
    [
        ("def f(:\n    pass\n", r"SyntaxError: invalid syntax \(.*\.py, line 1\)"),
        ("x = 1 / 0\n", r"ZeroDivisionError: division by zero"),
        ("raise AttributeError('attr at import')\n", r"AttributeError: attr at import"),
        ("undefined_name\n", r"NameError: name 'undefined_name' is not defined"),
        ("raise ValueError('import-time failure')\n", r"ValueError: import-time failure"),
        ("from os import no_such_name\n", r"ImportError: cannot import name 'no_such_name' from 'os'"),
        ("import sys\nsys.exit(3)\n", r"called sys\.exit\(3\)"),
        ("raise RuntimeError('needs a token HINT: run login first')\n", r"RuntimeError: needs a token\."),  # its HINT gives way to ours
        ("raise ModuleNotFoundError('optional backend missing')\n", r"ModuleNotFoundError: optional backend missing\."),  # found, then raised
    ],
)
@pytest.mark.parametrize("command", ["profile", "profile --datamodule", "bench"])
def test_an_error_while_importing_the_users_module_is_one_line(
    source: str, found: str, command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The user's module failing at import (any error, sys.exit too) is one line naming the module, that the error came
    while importing it, and the original error, with a HINT; exit 2, no traceback."""
    name = f"broken_{abs(hash((source, command))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    if command == "profile":
        argv = ["profile", f"{name}:Model", "--out", str(tmp_path / "p.json")]
    elif command == "profile --datamodule":
        argv = ["profile", "lightning.pytorch.demos.transformer:LightningTransformer", "--datamodule", f"{name}:Data", "--out", str(tmp_path / "p.json")]
    else:
        argv = ["bench", f"{name}:Model", "--world-size", "1", "--global-batch-size", "4", "--out", str(tmp_path / "b.json")]
    rc = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    what = "datamodule" if "--datamodule" in command else "model"
    assert re.search(rf"error: Importing module '{name}' for {what} '{name}:\w+' failed while running its code: {found}", lines[0]), lines[0]
    assert lines[0].count("HINT:") == 1 and f"python -c 'import {name}'" in lines[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{name}.py"]  # nothing written


def test_a_module_whose_dependency_is_missing_names_the_dependency(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "needs_dep_mod.py").write_text("import nonexistent_dep_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["profile", "needs_dep_mod:Model", "--out", str(tmp_path / "p.json")]) == 2
    line = capsys.readouterr().err.strip()
    assert "Importing module 'needs_dep_mod' for model 'needs_dep_mod:Model' failed: it imports 'nonexistent_dep_xyz', which is not installed" in line
    assert "HINT: Install the package that provides 'nonexistent_dep_xyz'" in line and "\n" not in line


def test_a_missing_module_of_the_users_own_package_is_not_called_uninstalled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "own_pkg_xyz").mkdir()
    (tmp_path / "own_pkg_xyz" / "__init__.py").write_text("")
    (tmp_path / "own_pkg_xyz" / "models.py").write_text("from .layerz import Block\n")  # a typo for .layers
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["profile", "own_pkg_xyz.models:Net", "--out", str(tmp_path / "p.json")]) == 2
    line = capsys.readouterr().err.strip()
    assert "it imports 'own_pkg_xyz.layerz', which its package 'own_pkg_xyz' does not have" in line and "not installed" not in line
    assert "HINT: Check that import in 'own_pkg_xyz.models'" in line and "\n" not in line


def test_a_model_in_the_current_folder_imports_as_under_python_m(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The console script's sys.path[0] is its own folder, not the current one (which `python -m` puts first): a
    model module in the folder the command runs from imports all the same."""
    import sys

    (tmp_path / "model_in_cwd.py").write_text(textwrap.dedent(
        """
        import torch
        from lightning.pytorch import LightningModule
        from torch.utils.data import DataLoader, TensorDataset

        class Tiny(LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
            def training_step(self, batch, batch_idx):
                return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)
            def train_dataloader(self):
                return DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=4)
        """
    ))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path), ".")])  # as under the console script
    rc, out, err = _run(["model_in_cwd:Tiny", "--micro-batch-sizes", "1,2", "--repeats", "1", "--device", "cpu", "--out", "p.json"], capsys)
    assert rc == 0, err
    assert Profile.load(tmp_path / "p.json").model == "model_in_cwd:Tiny"


def test_the_summary_names_parameters_the_loss_does_not_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A profile whose loss leaves trainable parameters without a gradient says so, with what data parallel needs."""
    (tmp_path / "model_unused_head.py").write_text(textwrap.dedent(
        """
        import torch
        from lightning_distplan.bench.models import WideMLP

        class UnusedHead(WideMLP):
            def __init__(self, **kw):
                super().__init__(**kw)
                self.aux_head = torch.nn.Linear(16, 3)  # used by no loss
        """
    ))
    monkeypatch.chdir(tmp_path)
    rc, out, err = _run(["model_unused_head:UnusedHead", "--init-args", '{"in_features": 16, "hidden": 8, "depth": 1}',
                         "--datamodule", "lightning_distplan.bench.models:RandomVectorData", "--datamodule-args", '{"in_features": 16, "batch_size": 4}',
                         "--micro-batch-sizes", "1,2", "--repeats", "1", "--device", "cpu", "--out", "p.json"], capsys)
    assert rc == 0, err
    assert Profile.load(tmp_path / "p.json").unused_parameters == ("aux_head.weight", "aux_head.bias")
    assert "unused: the loss gives no gradient to 2 trainable parameter(s) (aux_head.weight, aux_head.bias); data parallel training needs find_unused_parameters=True" in out


def test_distplan_debug_shows_the_traceback_of_our_own_errors_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """DISTPLAN_DEBUG=1 re-raises the package's own errors after their line (as it does for others), so the traceback
    shows, with the user's original error chained; without it, the line and exit 2."""
    from lightning_distplan.errors import DistPlanError, ProfilingError

    (tmp_path / "zerodiv_at_import.py").write_text("x = 1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = ["profile", "zerodiv_at_import:Model", "--out", str(tmp_path / "p.json")]
    assert main(argv) == 2
    monkeypatch.setenv("DISTPLAN_DEBUG", "1")
    with pytest.raises(ProfilingError, match="while running its code: ZeroDivisionError") as info:
        main(argv)
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    assert "error: Importing module 'zerodiv_at_import'" in capsys.readouterr().err
    with pytest.raises(DistPlanError):  # one that chains nothing
        main(["plan", "--profile", str(tmp_path / "missing.json"), "--world-size", "2", "--global-batch-size", "8"])


def test_a_ctrl_c_after_the_profile_was_written_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A Ctrl-C while the summary prints (the profile already saved) must not claim that no profile was written."""
    import io
    import sys

    class CtrlCOnSummary(io.StringIO):
        def write(self, text: str) -> int:
            if "written to" in text:  # the key lands as the summary's first line prints
                raise KeyboardInterrupt
            return super().write(text)

    out_file = tmp_path / "p.json"
    argv = [
        "lightning.pytorch.demos.transformer:LightningTransformer", "--init-args", json.dumps({"vocab_size": 16}),
        *_TINY, "--datamodule-args", json.dumps({"vocab_size": 16, "block_size": 4, "batch_size": 2, "num_samples": 8}),
        "--micro-batch-sizes", "1,2", "--repeats", "1", "--device", "cpu", "--quiet", "--out", str(out_file),
    ]
    monkeypatch.setattr(sys, "stdout", CtrlCOnSummary())
    rc = main(["profile", *argv])
    err = capsys.readouterr().err
    assert rc == 130
    assert err.strip().splitlines()[-1] == f"distplan profile: interrupted; the profile was written to {out_file}"
    assert Profile.load(out_file).micro_batch_sizes == (1, 2)


def test_a_datamodules_batch_transfer_hooks_run_on_the_profiled_micro_batches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """In a fit, Lightning runs the datamodule's on_before_batch_transfer / transfer_batch_to_device /
    on_after_batch_transfer where it overrides them (its _DataHookSelector); `distplan profile --datamodule` ran the
    model's only, so a datamodule that turns uint8 inputs into floats on the device (trained by Trainer.fit) failed
    with a dtype error in training_step."""
    (tmp_path / "model_uint8_data.py").write_text(textwrap.dedent(
        """
        import torch
        from lightning.pytorch import LightningDataModule, LightningModule
        from torch.utils.data import DataLoader, TensorDataset

        class Tiny(LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
            def training_step(self, batch, batch_idx):
                return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])
            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)

        class Uint8Data(LightningDataModule):
            def train_dataloader(self):
                x = torch.randint(0, 256, (16, 4), dtype=torch.uint8)
                return DataLoader(TensorDataset(x, torch.randint(0, 2, (16,))), batch_size=4)
            def on_after_batch_transfer(self, batch, dataloader_idx):
                return batch[0].float() / 255, batch[1]
        """
    ))
    monkeypatch.chdir(tmp_path)
    rc, out, err = _run(["model_uint8_data:Tiny", "--datamodule", "model_uint8_data:Uint8Data", "--micro-batch-sizes", "1,2",
                         "--repeats", "1", "--device", "cpu", "--out", "p.json"], capsys)
    assert rc == 0, err
    assert Profile.load(tmp_path / "p.json").micro_batch_sizes == (1, 2)


def test_the_summary_never_prints_a_nonzero_step_fit_as_zero(capsys: pytest.CaptureFixture[str]) -> None:
    """A tiny model's per-sample time under 0.5 µs printed "t(m) = 0.000 ms·m" (3 fixed decimals); format_ms gives it
    3 significant figures, and times from 1 ms up print as before."""
    from lightning_distplan._cli.profile import _summary
    from lightning_distplan.costmodel._synthetic import LayerSpec, synthetic_profile

    profile = synthetic_profile([LayerSpec(fwd_alpha=1e-7, fwd_beta=2e-6, bwd_alpha=2e-7, bwd_beta=4e-6, param_bytes=4096,
                                           activation_bytes_per_sample=1e3, output_bytes_per_sample=1e2)])
    _summary(profile, "p.json", 1.0)
    out = capsys.readouterr().out
    assert "step forward  t(m) = 0.000100 ms·m + 0.00200 ms  (R² " in out, out
    assert "step backward t(m) = 0.000200 ms·m + 0.00400 ms  (R² " in out, out
    big = synthetic_profile([LayerSpec(fwd_alpha=1.5e-3, fwd_beta=2e-3, bwd_alpha=3e-3, bwd_beta=4.25e-3, param_bytes=4096,
                                       activation_bytes_per_sample=1e3, output_bytes_per_sample=1e2)])
    _summary(big, "p.json", 1.0)
    out = capsys.readouterr().out
    assert "step forward  t(m) = 1.500 ms·m + 2.000 ms  (R² " in out and "step backward t(m) = 3.000 ms·m + 4.250 ms  (R² " in out, out
