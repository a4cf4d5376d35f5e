"""Bad numbers and bad files end in one line, exit 2: integers beyond int64 and absurd
micro-batch counts in every command, the benchmark tools on a file of the wrong shape,
and a flag another policy reads warned about, not warned about and then refused."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from dist_util import load_benchmark
from lrmoe.cli import main
from test_reliability import one_error_line, train, write_corpus

BIG = "99999999999999999999"  # beyond int64


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("data"))


@pytest.mark.parametrize("argv, words", [
    (["plan", "--preset", "tiny-qwen3", "--ep", "2", "--tokens-per-rank", BIG],
     ["--tokens-per-rank", BIG, "<="]),
    (["plan", "--preset", "tiny-qwen3", "--ep", "2", "--tokens-per-rank", str(2**63 - 1)],
     ["--tokens-per-rank", "<="]),
    (["plan", "--preset", "tiny-qwen3", "--ep", BIG], ["--ep", BIG]),
    (["plan", "--preset", "tiny-qwen3", "--compare", "--tokens-per-rank", BIG],
     ["--tokens-per-rank", BIG]),
    (["plan", "--preset", "tiny-qwen3", "--ep", "2", "--seed", BIG], ["--seed", BIG]),
])
def test_plan_refuses_integers_beyond_range(argv, words, capsys):
    assert main(argv) == 2
    one_error_line(capsys.readouterr().err, *words)


@pytest.mark.parametrize("flags, words", [
    (["--steps", BIG], ["--steps", BIG, "<="]),
    (["--grad-accum", str(2**63 - 1)], ["--grad-accum", "int64"]),
    (["--seed", BIG], ["--seed", BIG]),
    (["--eval-every", BIG], ["--eval-every", BIG]),
    (["--slots-per-rank", BIG], ["--slots-per-rank", BIG]),
])
def test_bench_refuses_integers_beyond_range_before_writing(tmp_path, capsys, flags, words):
    out = tmp_path / "out"
    assert main(["bench", "ttl", "--preset", "tiny-qwen3", "--ep", "2", *flags,
                 "--out", str(out)]) == 2
    one_error_line(capsys.readouterr().err, *words)
    assert not out.exists()


@pytest.mark.parametrize("flag", ["--eval-batches", "--threads"])
def test_eval_refuses_a_count_below_one_before_reading_the_run(tmp_path, capsys, flag):
    assert main(["eval", str(tmp_path), flag, "0"]) == 2
    one_error_line(capsys.readouterr().err, flag, ">= 1")


def test_train_refuses_a_run_whose_token_count_leaves_int64(tmp_path, text, capsys):
    out = tmp_path / "out"
    assert train(out, text, "--steps", "1", "--grad-accum", str(2**63 - 1)) == 2
    one_error_line(capsys.readouterr().err, "--grad-accum", "int64")
    assert not out.exists()


def test_train_warns_when_one_step_reads_the_data_more_than_once(tmp_path, text, capsys):
    """About 70 windows of 512 tokens in the corpus; a step of 20 x 4 sequences."""
    assert train(tmp_path / "out", text, "--steps", "1", "--seq-len", "512",
                 "--grad-accum", "20") == 0
    warns = [ln for ln in capsys.readouterr().err.splitlines() if "warning" in ln]
    assert len(warns) == 1 and "--grad-accum 20" in warns[0] and "windows" in warns[0], warns


def test_a_flag_static_ignores_is_warned_about_not_refused(tmp_path, text, capsys):
    assert train(tmp_path / "out", text, "--steps", "1", "--slots-per-rank", "4",
                 "--policy", "static") == 0
    err = capsys.readouterr().err
    assert "--slots-per-rank 4 has no effect with --policy static" in err
    assert "error" not in err


def test_a_flag_lrmoe_refuses_is_refused_without_a_warning(tmp_path, text, capsys):
    assert train(tmp_path / "out", text, "--steps", "1", "--recompute", "--policy",
                 "lrmoe") == 2
    err = capsys.readouterr().err
    one_error_line(err, "recompute")
    assert "warning" not in err, err


# ----------------------------------------------------------------------------- benchmark tools
REAL = Path(__file__).resolve().parents[1] / "benchmarks/results/ttl_qwen3_2gib/s0"


def _ttl(d: Path, obj) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "ttl.json").write_text(json.dumps(obj))
    return d


def _broken_reports() -> dict[str, object]:
    real = json.loads(gzip.decompress((REAL / "ttl.json.gz").read_bytes()))
    no_static = json.loads(json.dumps(real))
    del no_static["policies"]["static"]
    bad_steps = json.loads(json.dumps(real))
    bad_steps["policies"]["symi"]["steps"] = "none"
    bad_evals = json.loads(json.dumps(real))
    bad_evals["policies"]["static"]["evals"] = [{"step": 1}]
    return {"list": [1, 2], "empty": {}, "no static": no_static, "steps a string": bad_steps,
            "evals without loss": bad_evals, "target a list": dict(real, target=[1])}


@pytest.mark.parametrize("case", list(_broken_reports()))
@pytest.mark.parametrize("tool, extra", [("summarize_ttl", []), ("summarize_ttl", ["--seeds"]),
                                         ("reprice_links", ["--link", "ib"])])
def test_benchmark_tools_end_a_wrong_shape_in_one_line(tmp_path, capsys, case, tool, extra):
    run = _ttl(tmp_path / "run", _broken_reports()[case])
    assert load_benchmark(tool).main([*extra, str(run)]) == 2
    one_error_line(capsys.readouterr().err, str(run))


@pytest.mark.parametrize("trace", [
    [1, 2], {"model": {}, "ep": 2, "tokens_per_rank": 4, "steps": []},
    {"model": "x", "ep": 2, "tokens_per_rank": 4, "steps": [[[1, 2]]]},
    {"model": {"model_type": "qwen3_moe"}, "ep": "2", "tokens_per_rank": 4, "steps": [[[1]]]},
])
def test_floor_budget_ends_a_wrong_trace_in_one_line(tmp_path, capsys, trace):
    f = tmp_path / "routing_trace_static.json"
    f.write_text(json.dumps(trace))
    assert load_benchmark("floor_budget").run(["--device", "cpu", str(f)]) == 2
    one_error_line(capsys.readouterr().err, str(f))


def test_floor_budget_ends_a_wrong_ttl_json_beside_the_trace_in_one_line(tmp_path, capsys):
    import shutil

    d = tmp_path / "run"
    d.mkdir()
    shutil.copy(REAL / "routing_trace_static.json.gz", d)
    (d / "ttl.json").write_text(json.dumps({"config": "x"}))
    assert load_benchmark("floor_budget").run([str(d)]) == 2
    one_error_line(capsys.readouterr().err, str(d / "ttl.json"))
