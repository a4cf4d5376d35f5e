"""One spelling per policy knob: every command's parser takes the same flags
(:mod:`lrmoe.cli_flags`), refuses the old spellings with one line, and train's flat
flags nest into :class:`~lrmoe.policy.registry.PolicyConfig` and back."""

from __future__ import annotations

import argparse

import pytest

from lrmoe.cli import build_parser, main
from lrmoe.cli_flags import BENCH, KNOBS, PLAN, RENAMED, TRAIN
from lrmoe.policy.registry import PolicyConfig
from lrmoe.train.config import TrainConfig, config_from_cli

# the parser's subcommand path and the arguments it needs besides the flags under test
COMMANDS = {"train": (["train"], TRAIN), "plan": (["plan", "--preset", "tiny-qwen3"], PLAN),
            "bench ttl": (["bench", "ttl", "--preset", "tiny-qwen3", "--out", "x"], BENCH)}
VALUES = {"policy": ["lrmoe"], "capacity_factor": ["2.0"], "slots_per_rank": ["5"],
          "mem_budget": ["1GiB"], "recompute": [], "optimizer_offload": ["host"],
          "router_grad": ["experts"], "lrmoe_recompute": [], "lrmoe_placement": ["previous"],
          "lrmoe_metric": ["gate"], "lrmoe_estimator": ["sampled"], "lrmoe_min_keep": ["0.25"],
          "lrmoe_balance": ["0.5"], "lrmoe_compaction": ["off"], "lrmoe_selection": ["off"],
          "lrmoe_select_from": ["4"], "lrmoe_fidelity_every": ["3"], "lrmoe_keep": ["auto"],
          "lrmoe_target_cosine": ["0.9"],
          "lrmoe_max_slots": ["6"]}


def _option_strings(argv0: list[str]) -> set[str]:
    """Every option string the command's parser declares."""
    p = build_parser()
    for word in argv0:
        if word.startswith("--"):
            break
        p = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices[word]
    return {s for a in p._actions for s in a.option_strings if a.help != argparse.SUPPRESS}


def test_every_knob_has_one_spelling_everywhere():
    assert set(VALUES) == set(KNOBS)
    spelled = {n: KNOBS[n].flag for n in KNOBS}
    for n, flag in spelled.items():  # lrmoe-only knobs carry the prefix, the shared ones not
        assert flag == "--" + n.replace("_", "-")
    for cmd, (argv0, names) in COMMANDS.items():
        declared = _option_strings(argv0)
        for n in names:
            assert spelled[n] in declared, (cmd, n)
        # no other spelling of any knob, here or in another command
        for flag in spelled.values():
            short = flag.removeprefix("--lrmoe-")
            if flag.startswith("--lrmoe-") and short.replace("-", "_") not in KNOBS:
                assert f"--{short}" not in declared, (cmd, short)
        assert not set(RENAMED) & declared, cmd


@pytest.mark.parametrize("cmd", COMMANDS)
def test_each_command_parses_the_same_spelling(cmd):
    argv0, names = COMMANDS[cmd]
    argv = list(argv0)
    for n in names:
        argv += [KNOBS[n].flag, *VALUES[n]]
    ns = build_parser().parse_args(argv)
    for n in names:
        got = getattr(ns, n)
        want = VALUES[n][0] if VALUES[n] else True
        if KNOBS[n].metavar == "on|off":
            want = want == "on"
        elif KNOBS[n].type in (int, float):
            want = KNOBS[n].type(want)
        assert got == want, (cmd, n, got)


@pytest.mark.parametrize("cmd", COMMANDS)
@pytest.mark.parametrize("old", sorted(RENAMED))
def test_old_spellings_are_refused(cmd, old, capsys):
    argv0, _ = COMMANDS[cmd]
    assert main(argv0 + [old, "0.5"]) == 2
    err = capsys.readouterr().err
    assert f"{old} is now {RENAMED[old]}" in err, err


def test_flat_flags_nest_and_flatten():
    given = {"preset": "tiny-qwen3", "policy": "lrmoe", "lrmoe_min_keep": 0.25,
             "lrmoe_selection": False, "lrmoe_metric": "gate", "slots_per_rank": 5,
             "recompute": False, "capacity_factor": 2.0}
    cfg = config_from_cli(given)
    pc = cfg.policy
    assert isinstance(pc, PolicyConfig) and pc.name == "lrmoe" and pc.slots_per_rank == 5
    assert (pc.lrmoe.min_keep, pc.lrmoe.selection, pc.backward.metric) == (0.25, False, "gate")
    assert pc.capacity_factor == 2.0
    flat = cfg.flat()
    assert {k: flat[k] for k in given} == given
    assert TrainConfig.from_flat(flat) == cfg
    # a config.json saved with the flat names before the nesting reads the same
    assert "policy" in flat and not isinstance(flat["policy"], PolicyConfig)


def test_bad_value_names_the_flag():
    from lrmoe.errors import LrmoeError
    with pytest.raises(LrmoeError, match="--lrmoe-min-keep 1.5 must be"):
        config_from_cli({"preset": "tiny-qwen3", "lrmoe_min_keep": 1.5})
    with pytest.raises(LrmoeError, match="--lrmoe-estimator 'x' is not valid"):
        TrainConfig.from_flat(lrmoe_estimator="x")


def test_resume_reads_a_config_saved_before_the_nesting(tmp_path):
    """A run's config.json as written when every policy knob was a TrainConfig field
    (flat keys): --resume inherits the knobs into the nested policy config."""
    import json

    from lrmoe.train.config import RUN_CONFIG, RUN_FORMAT

    old = {"preset": "tiny-qwen3", "steps": 7, "policy": "lrmoe", "capacity_factor": 1.25,
           "slots_per_rank": 6, "recompute": False, "lrmoe_recompute": True,
           "lrmoe_placement": "previous", "optimizer_offload": "device",
           "router_grad": "home", "mem_budget": "1GiB", "lrmoe_metric": "gate",
           "lrmoe_estimator": "sampled", "lrmoe_min_keep": 0.3, "lrmoe_balance": 0.5,
           "lrmoe_compaction": False, "lrmoe_selection": True, "lrmoe_fidelity_every": 2,
           "lrmoe_keep": "auto", "lrmoe_target_cosine": 0.95}
    (tmp_path / RUN_CONFIG).write_text(json.dumps({"format": RUN_FORMAT, "train": old}))
    cfg = config_from_cli({"out": str(tmp_path), "resume": True})
    lc, bw = cfg.policy.lrmoe, cfg.policy.backward
    assert (cfg.policy.name, cfg.policy.slots_per_rank, cfg.steps) == ("lrmoe", 6, 7)
    assert (lc.recompute, lc.placement, bw.metric, bw.estimator, lc.min_keep, lc.balance,
            bw.compaction, cfg.policy.fidelity.every, lc.keep, lc.target_cosine) == (
        True, "previous", "gate", "sampled", 0.3, 0.5, False, 2, "auto", 0.95)
    flat = cfg.flat()
    assert {k: flat[k] for k in old if k != "preset"} == {k: v for k, v in old.items()
                                                          if k != "preset"}
