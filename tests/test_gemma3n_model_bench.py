"""altup_cupy.lab.gemma3n_model on the CPU: the tiny config end to end (eager, patched and not), the
CSV it appends to, and the configs it builds for the GPU (counted on the meta device only)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from gemma3n_support import count_altup_calls, transformers_gemma3n

transformers_gemma3n()
from altup_cupy.lab import gemma3n_model as bench  # noqa: E402

SHA = "0123456789ab"


@pytest.fixture(autouse=True)
def _fixed_sha(monkeypatch):
    monkeypatch.setenv("ALTUP_GIT_SHA", SHA)
    yield
    torch._dynamo.reset()


def _rows(path):
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        return tuple(reader.fieldnames), list(reader)


def _run(out, *extra):
    return bench.main(["--device", "cpu", "--config", "tiny", "--out", str(out), "--reps", "2", "--warmup", "1",
                       "--no-progress", *extra])


@pytest.fixture
def op_calls(monkeypatch):
    """How often a step reached each altup_cupy.torch function (the patched model's route)."""
    return count_altup_calls(monkeypatch.setattr)


def test_tiny_cpu_run_writes_one_row_per_case(tmp_path, op_calls):
    out = tmp_path / "results" / "gemma3n_model.csv"
    assert _run(out) == 0
    columns, rows = _rows(out)
    assert columns == bench.COLUMNS
    assert [(r["task"], r["mode"], r["patched"]) for r in rows] == [
        ("train", "eager", "0"), ("train", "eager", "1"), ("prefill", "eager", "0"), ("prefill", "eager", "1")]
    for r in rows:
        assert (r["config"], r["batch"], r["seq"], r["git_sha"]) == ("tiny", "2", "16", SHA)
        assert r["gpu_ms"] == "" and r["peak_mib"] == ""  # no GPU: blank
        assert float(r["wall_ms"]) > 0
        assert r["date"].endswith("Z")
    # Only the patched cases go through altup_cupy: (1 warm-up + 2 timed steps) x 2 tasks, 2 layers each.
    assert op_calls == {"predict": 12, "correct": 12, "expand": 6, "collapse": 6}
    # the spread of each case beside it, under the same key, commit and date
    spread_columns, spreads = _rows(bench.spread_path(out))
    assert spread_columns == bench.SPREAD_COLUMNS
    key = ("config", "task", "mode", "patched", "batch", "seq", "git_sha", "date")
    assert [[s[k] for k in key] for s in spreads] == [[r[k] for k in key] for r in rows]
    for r, s in zip(rows, spreads):
        assert s["gpu_p10_ms"] == s["gpu_p90_ms"] == "" and s["reps"] == "2"
        assert 0 < float(s["wall_p10_ms"]) <= float(r["wall_ms"]) <= float(s["wall_p90_ms"])


def test_rows_append_resume_and_keep_their_header(tmp_path, capsys):
    out = tmp_path / "model.csv"
    assert _run(out, "--tasks", "prefill", "--patched", "0") == 0
    assert _run(out, "--tasks", "prefill", "--patched", "0,1", "--resume") == 0  # only the missing case runs
    assert "1 cases (1 already in" in capsys.readouterr().out
    _, rows = _rows(out)
    assert [(r["task"], r["patched"]) for r in rows] == [("prefill", "0"), ("prefill", "1")]
    other = tmp_path / "other.csv"
    other.write_text("op,impl\n")
    with pytest.raises(ValueError, match="columns"):
        bench.append_row(other, dict.fromkeys(bench.COLUMNS, ""))


def test_an_out_that_cannot_be_written_is_refused_before_any_case(tmp_path):
    """A path the process cannot create is refused up front (permission bits alone would not say:
    root may write anywhere but in /proc), and a checked new file is not left behind."""
    with pytest.raises(ValueError, match="cannot be written"):
        bench.check_writable(Path("/proc/altup_cupy_model.csv"))
    fresh = tmp_path / "made" / "model.csv"
    bench.check_writable(fresh)
    assert fresh.parent.is_dir() and not fresh.exists()


def test_a_failed_case_writes_no_row_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    real = bench.run_case

    def failing(case, **kwargs):
        if case.patched:
            raise torch.OutOfMemoryError("pretend")
        return real(case, **kwargs)

    monkeypatch.setattr(bench, "run_case", failing)
    out = tmp_path / "model.csv"
    assert _run(out, "--tasks", "train") == 1
    _, rows = _rows(out)
    assert [r["patched"] for r in rows] == ["0"]
    printed = capsys.readouterr().out
    assert "FAILED tiny train eager patched 2x16: OutOfMemoryError: pretend" in printed
    assert "FAILED: 1" in printed


def test_time_limit_starts_no_case_past_it(tmp_path, capsys):
    out = tmp_path / "model.csv"
    assert _run(out, "--time-limit-s", "0") == 0
    assert not out.exists()
    assert "not started (time limit 0 s): 4" in capsys.readouterr().out


def test_regional_compilation_is_written_in_the_mode():
    case = bench.Case("mini", "train", "compile", 1, 8, 1024)
    assert case.key(regional=True)[2] == "compile_regional"
    assert bench.mode_label("eager", regional=True) == "eager"  # nothing compiled, nothing to say


def test_patched_and_unpatched_models_have_the_same_weights():
    plain = bench.build_model("tiny", patched=False, device="cpu", seed=3)
    patched = bench.build_model("tiny", patched=True, device="cpu", seed=3)
    assert "predict" in patched.model.layers[0].altup.__dict__  # the instance is patched
    a, b = plain.state_dict(), patched.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert 0.2 < plain.model.layers[0].altup.prediction_coefs.weight.std() < 0.4  # redrawn, std 0.3


def test_gpu_configs_have_the_published_sizes():
    e2b = bench.text_config("e2b")
    assert (e2b.num_hidden_layers, e2b.hidden_size, e2b.vocab_size, e2b.vocab_size_per_layer_input) == (
        30, 2048, 262400, 262144)
    assert e2b.intermediate_size == [8192] * 30 and e2b.num_kv_shared_layers == 10
    assert e2b.layer_types[:5] == ["sliding_attention"] * 4 + ["full_attention"]
    assert e2b.layer_types.count("full_attention") == 6
    assert e2b.activation_sparsity_pattern == [0.95] * 10 + [0.0] * 20
    assert (e2b.num_attention_heads, e2b.num_key_value_heads, e2b.head_dim, e2b.laurel_rank,
            e2b.hidden_size_per_layer_input, e2b.altup_num_inputs, e2b.sliding_window) == (8, 2, 256, 64, 256, 4, 512)
    mini = bench.text_config("mini")
    assert (mini.num_hidden_layers, mini.hidden_size, mini.vocab_size, mini.altup_num_inputs) == (4, 2048, 32768, 4)
    assert mini.activation_sparsity_pattern == [0.95, 0.95, 0.0, 0.0]
    # E2B's text model: 4.44 B parameters here (the published checkpoint also stores the KV
    # projections of its 10 KV-sharing layers, which transformers drops on loading).
    assert 4.40e9 < bench.parameter_count("e2b") < 4.46e9


def test_token_ids_stay_inside_both_vocabularies():
    """E2B's per-layer embedding has fewer rows than its token embedding; an id past it failed the
    unpatched e2b step on the GPU under transformers 5.17 (no masking there)."""
    e2b = bench.text_config("e2b")
    ids = bench.text_token_ids(e2b, 8, 1024, 0)
    assert ids.shape == (8, 1024) and ids.dtype == torch.int64
    assert int(ids.min()) >= 3 and int(ids.max()) < e2b.vocab_size_per_layer_input < e2b.vocab_size
    assert int(ids.max()) > 0.99 * e2b.vocab_size_per_layer_input  # the whole text range is drawn
    assert torch.equal(ids, bench.text_token_ids(e2b, 8, 1024, 0))


def test_op_registration_probe_times_every_registration_on_cpu():
    """altup_cupy.lab.op_registration: a row per registration and autograd setting, and the
    shipped operators' rows, every time positive (the probe operators register under their own
    namespace, so measuring twice in one process must work too)."""
    from altup_cupy.lab import op_registration

    for _ in range(2):
        rows = op_registration.measure("cpu", number=5)
        assert [(r["registration"], r["autograd"]) for r in rows] == [
            ("custom_op", 0), ("custom_op", 1), ("Library", 0), ("Library", 1), ("Operator", 0), ("Operator", 1),
            ("altup_cupy.torch.predict", 0), ("altup_cupy.torch.correct", 0),
            ("altup_cupy.torch.predict", 1), ("altup_cupy.torch.correct", 1)]
        assert all(r["us_per_call"] > 0 for r in rows)


def test_speedup_table_counts_the_last_row_of_each_case(tmp_path):
    path = tmp_path / "gemma3n_model.csv"
    case = dict(config="mini", task="train", batch=8, seq=1024, gpu_ms="1.0", peak_mib="1.0", date="2026-12-04")
    for mode, patched, wall_ms, sha in (("eager", 0, "90.0", "aaa"), ("eager", 1, "60.0", "aaa"),
                                        ("eager", 1, "45.0", "bbb"), ("compile", 0, "30.0", "bbb")):
        bench.append_row(path, {**case, "mode": mode, "patched": patched, "wall_ms": wall_ms, "git_sha": sha})
    cases, commits = bench.recorded_cases(path)
    assert commits == ["aaa", "bbb"] and cases[("mini", "train", "8", "1024", "eager", "1")]["wall_ms"] == "45.0"
    table = bench.speedup_table(path)
    assert "commits aaa, bbb (the last row of each case counts)" in table
    assert table.endswith("| mini | train | 8 x 1024 | 45.0 / 90.0 (2.00×) | — / 30.0 |")


def test_p10_p90_interpolates_between_the_samples():
    assert bench.p10_p90([5.0]) == (5.0, 5.0)
    assert bench.p10_p90([1.0, 2.0]) == pytest.approx((1.1, 1.9))
    assert bench.p10_p90([float(x) for x in range(11)]) == pytest.approx((1.0, 9.0))


def test_spreads_belong_to_the_rows_that_count(tmp_path):
    path = tmp_path / "gemma3n_model.csv"
    case = dict(config="mini", task="train", mode="eager", batch=8, seq=1024, gpu_ms="1.0", wall_ms="2.0",
                peak_mib="1.0")
    spread = dict(config="mini", task="train", mode="eager", batch=8, seq=1024, gpu_p10_ms="0.9", gpu_p90_ms="1.1",
                  wall_p10_ms="1.8", wall_p90_ms="2.2", reps=20)
    for patched, sha, date in ((0, "aaa", "d1"), (1, "aaa", "d1"), (1, "bbb", "d2")):
        bench.append_row(path, {**case, "patched": patched, "git_sha": sha, "date": date})
    assert bench.recorded_spreads(path) == {}  # no spread file: an older run
    for patched, sha, date in ((0, "aaa", "d1"), (1, "aaa", "d1")):  # the patched row of bbb has none
        bench.append_row(bench.spread_path(path), {**spread, "patched": patched, "git_sha": sha, "date": date},
                         bench.SPREAD_COLUMNS)
    spreads = bench.recorded_spreads(path)
    assert list(spreads) == [("mini", "train", "8", "1024", "eager", "0")]
    assert bench.spread_path(path).name == "gemma3n_model_spread.csv"
