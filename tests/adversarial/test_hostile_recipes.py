"""Hostile recipe files through `recipe check`, `recipe show --json` and `estimate --json`: each is refused
with `error:` lines, fast, writing nothing (alias bombs, validation gaps, tracebacks)."""
from __future__ import annotations

import os

import pytest
from hostile import RECIPES, invoke


def alias_bomb(levels: int = 9, fan: int = 9, head: str = "lol") -> str:
    """YAML "billion laughs": ``levels`` anchors, each a list of ``fan`` aliases to the previous one."""
    lines = [f"b0: &b0 [{', '.join([head] * fan)}]"]
    lines += [f"b{i}: &b{i} [{', '.join([f'*b{i - 1}'] * fan)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def nested(depth: int) -> str:
    return "model:\n  notes: " + "[" * depth + "]" * depth + "\n"


def block_nested(depth: int) -> str:
    return "parallel:\n  deepspeed:\n" + "".join(" " * (4 + i) + f"k{i}:\n" for i in range(depth)) + " " * (4 + depth) + "1\n"


BOMB = "error: {path}: more than 100,000 values once YAML aliases are expanded"

# (id, file content, the start of the expected first error line after "error: PATH: ")
CASES = [
    ("alias-bomb-in-d_model", alias_bomb() + "model: {d_model: *b8}\n", "more than 100,000 values"),
    ("alias-bomb-in-deepspeed", alias_bomb() + "parallel: {engine: deepspeed, deepspeed: {x: *b8}}\n",
     "more than 100,000 values"),
    ("alias-bomb-in-notes", alias_bomb() + "model: {notes: *b8}\n", "more than 100,000 values"),
    ("merge-key-bomb", "m0: &m0 {a: 1, b: 2}\n" + "".join(
        f"m{i}: &m{i} {{<<: [{', '.join([f'*m{i - 1}'] * 9)}]}}\n" for i in range(1, 9)) + "model: {<<: *m8}\n",
     "model.a: unknown key"),  # merges collapse into one small mapping: harmless, and fast
    ("recursive-alias", "parallel: {engine: deepspeed, deepspeed: &d {self: *d}}\n", "a YAML alias refers to"),
    ("recursive-list", "model: {feature_groups: &g [1, *g]}\n", "a YAML alias refers to"),
    ("deep-flow-nesting", nested(5000), "malformed YAML"),
    ("deep-block-nesting", block_nested(1200), "malformed YAML"),
    ("nesting-past-the-limit", nested(80), "nested more than 64 levels deep"),
    ("many-values", "model: {notes: [" + ", ".join(["x"] * 120_000) + "]}\n", "more than 100,000 values"),
    ("huge-file", "# " + "x" * (2**20 + 10) + "\nmodel: {}\n", "larger than 1 MiB"),
    ("non-utf8", b"model:\n  attention: \xff\xfe mla\n", "not a UTF-8 text file (byte 20)"),
    ("nul-byte", "model:\n  d_model: 64\x00\n", "malformed YAML"),
    ("integer-past-digit-limit", "model:\n  d_model: " + "9" * 5000 + "\n", "malformed YAML"),
    ("python-tag", "model: !!python/object/apply:os.system ['touch pwned-by-yaml']\n", "malformed YAML"),
    ("python-name-tag", "model: {d_model: !!python/name:os.system}\n", "malformed YAML"),
    ("binary-in-deepspeed", "parallel: {engine: deepspeed, deepspeed: {blob: !!binary aGVsbG8=}}\n",
     "parallel.deepspeed: blob: a bytes is not a JSON value"),
    ("date-in-deepspeed", "parallel: {engine: deepspeed, deepspeed: {when: 2024-01-01}}\n",
     "parallel.deepspeed: when: a date is not a JSON value"),
    ("set-in-deepspeed", "parallel: {engine: deepspeed, deepspeed: {s: !!set {a, b}}}\n",
     "parallel.deepspeed: s: a set is not a JSON value"),
    ("int-key-in-deepspeed", "parallel: {engine: deepspeed, deepspeed: {1: 2}}\n",
     "parallel.deepspeed.1.[key]: Input should be a valid string"),
    ("nested-int-key-in-deepspeed", "parallel: {engine: deepspeed, deepspeed: {zero_optimization: {1: 2}}}\n",
     "parallel.deepspeed: zero_optimization: key 1 is not a string"),
    ("inf-in-deepspeed", "parallel: {engine: deepspeed, deepspeed: {zero_optimization: {x: .inf}}}\n",
     "parallel.deepspeed: zero_optimization.x: inf is not a finite number"),
    ("inf-lr", "train: {lr: .inf}\n", "train.lr: Input should be a finite number"),
    ("nan-norm-eps", "model: {norm_eps: .nan}\n", "model.norm_eps: Input should be a finite number"),
    ("inf-capacity-factor", "model: {capacity_factor: .inf}\n", "model.capacity_factor: Input should be a finite"),
    ("negative-inf-rope-theta", "model: {rope_theta: -.inf}\n", "model.rope_theta: Input should be a finite"),
    ("n_layers-1e30", "model: {n_layers: " + "1" + "0" * 30 + "}\n", "model.n_layers: Input should be less than"),
    ("d_model-1e19", "model: {d_model: 10000000000000000000}\n", "model.d_model: Input should be less than"),
    ("vocab-times-d_model-past-int64", "model: {vocab_size: 4294967296, d_model: 1048576, n_heads: 1024}\n",
     "model: up to 9.04e+15 weights (n_layers=8, d_model=1048576, vocab_size=4294967296, ...)"),
    ("experts-past-the-bound", "model: {ffn: moe, n_routed_experts: 1048576, num_experts_per_tok: 2, "
     "moe_intermediate_size: 1048576, d_model: 1024, n_layers: 64}\n", "model: up to "),
    ("seed-past-int64", "train: {seed: 100000000000000000000000}\n", "train.seed: must fit a 64-bit integer"),
    ("negative-steps", "train: {steps: -3}\n", "train.steps: Input should be greater than 0"),
    ("duplicate-key", "model:\n  d_model: 64\n  d_model: 128\n", "malformed YAML at line 3"),
    ("megabyte-unknown-key", "model:\n  ? " + "k" * 500_000 + "\n  : 1\n",  # an explicit key: no length limit
     "model." + "k" * 28 + "..." + "k" * 29 + ": unknown key"),
    ("megabyte-value", "model: {attention: " + "m" * 500_000 + "}\n", "model.attention: Input should be"),
    ("list-at-top", "- model\n- train\n", "a recipe is a mapping of sections"),
    ("scalar-section", "model: 5\n", "model: Input should be a valid dictionary"),
    ("tab-indent", "model:\n\td_model: 64\n", "malformed YAML"),
    ("two-documents", "model: {}\n---\ntrain: {}\n", "malformed YAML"),
    ("a-sweep-file", "recipe: tiny.yaml\ngrid: {model.d_model: [64]}\nmodes: [estimate]\n", "this is a sweep file"),
    ("kv_lora_rank-zero-for-mla", "model: {attention: mla}\n", "model.kv_lora_rank: must be > 0"),
    ("partial-rotary-odd", "model: {d_model: 64, n_heads: 4, partial_rotary_factor: 0.2}\n",
     "model.partial_rotary_factor: 0.2 of head_dim=16 rotates 3"),
    ("typo-under-inactive-kind", "model: {attention: mha, kv_lora_rnk: 8}\n",
     "model.kv_lora_rnk: unknown key; did you mean 'kv_lora_rank'?"),
]


@pytest.fixture
def hostile_file(tmp_path):
    def write(content) -> os.PathLike:
        p = tmp_path / "in" / "recipe.yaml"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
        return p
    return write


COMMANDS = {"check": ["recipe", "check"], "show-json": ["recipe", "show", "--json"], "estimate": ["estimate", "--json"]}
SLOW = {"many-values"}  # parsing 10^5 scalars takes seconds: through one command only


@pytest.mark.parametrize("command, content, expected", [
    pytest.param(command, content, expected, id=f"{case}-{name}")
    for case, content, expected in CASES for name, command in COMMANDS.items() if case not in SLOW or name == "check"])
def test_hostile_recipe_file_is_refused(tmp_path, monkeypatch, hostile_file, command, content, expected):
    path = hostile_file(content)
    monkeypatch.chdir(tmp_path)  # anything written to the working directory would show below
    lines, _ = invoke([command[0], *command[1:2], str(path), *command[2:]], within=tmp_path)
    assert lines[0].startswith(f"error: {path}: {expected}"), lines[0][:300]
    assert not (tmp_path / "pwned-by-yaml").exists()


@pytest.mark.parametrize("make, expected", [
    (lambda d: d, "not a regular file"),
    (lambda d: (os.mkfifo(d / "fifo.yaml"), d / "fifo.yaml")[1], "not a regular file"),
    (lambda d: "/dev/zero", "not a regular file"),
    (lambda d: d / "missing.yaml", "no such file"),
    (lambda d: (d / "link.yaml").symlink_to("/dev/zero") or d / "link.yaml", "not a regular file"),
], ids=["directory", "fifo", "dev-zero", "missing", "symlink-to-dev-zero"])
def test_what_is_not_a_recipe_file_is_named(tmp_path, make, expected):
    path = make(tmp_path)
    lines, _ = invoke(["recipe", "show", str(path)], within=tmp_path)
    assert lines == [f"error: {path}: {expected}"]


def test_a_name_too_long_is_one_short_line(tmp_path):
    path = tmp_path / ("r" * 5000 + ".yaml")
    lines, _ = invoke(["recipe", "check", str(path)], within=tmp_path)
    assert len(lines) == 1 and lines[0].endswith("rrrr.yaml: cannot read: File name too long") and "..." in lines[0]


@pytest.mark.parametrize("sets, expected", [
    (("parallel.zero_stage=3",), "parallel.zero_stage: only used by engine=deepspeed, but parallel.engine=single"),
    (("parallel.engine=deepspeed", "parallel.deepspeed={optimizer: {type: Adam}}"), "parallel.deepspeed.optimizer: "),
    (("parallel.engine=deepspeed", "parallel.deepspeed={zero_optimization: {stage: 3}}"),
     "parallel.deepspeed.zero_optimization.stage=3 conflicts with parallel.zero_stage (= 1)"),
])
def test_check_refuses_what_train_refuses(tmp_path, sets, expected):
    args = [a for s in sets for a in ("--set", s)]
    lines, _ = invoke(["recipe", "check", str(RECIPES / "tiny.yaml"), *args], within=tmp_path)
    assert len(lines) == 1 and expected in lines[0]
