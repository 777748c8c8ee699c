"""Case grid, runner and golden-data format of the engine regression test.

Shared by ``tests/regression/record_engine_golden.py`` (which runs every case and writes
``tests/data/engine_golden.{json,safetensors}``) and ``tests/test_engine_regression.py`` (which replays
the recorded cases and compares), so the replay runs exactly what was recorded. Only the public API is
used: ``KVCache``, ``list_policies``, ``prefill_shared``, ``head_lengths``, ``kept_positions`` and plain
model forwards.

A *case* is a JSON-serialisable dict::

    {"id": "prefill-b1-snapkv", "kind": "prefill", "shared": False,
     "members": [{"policy": "snapkv", "params": {"budget": 12, "window": 4}}],
     "inputs": {"rows": [[40, 101]], "padded": False},
     "program": [["prompt"], ["decode"], ["decode"], ["extend", 10, 145], ...]}

``inputs.rows`` are ``[length, seed]`` pairs of ``helpers.prompt``; with ``padded`` the rows are
left-padded into one batch (``helpers.left_pad``) and the attention mask is passed and extended by ones
on every later forward; otherwise there is one row and no mask. The ``program`` is one model forward
per op: ``prompt`` (the prompt), ``decode`` (the greedy next token of the previous forward) or
``extend`` (``length`` new tokens of ``helpers.prompt(batch, length, seed)``, a second turn). A shared
case (``shared``) runs its first op as one ``kvsieve.prefill_shared(..., logits_to_keep=1)`` for
every member, then the rest of the program for each member in turn.

Recorded per member (a *track*) after every forward: ``head_lengths()``, ``kept_positions(layer, b, h)``
of every (layer, batch row, KV head) (stored as bitmasks over the positions seen), the greedy token of
each row and a float64 fingerprint (max, min, mean, logsumexp) of each row's last-position logits; the
full last-position logits (float32) only at :func:`logit_points` (every multi-token forward and the
last forward), to keep the data file small. Replays feed the recorded tokens at the decoding steps
(teacher forcing), so a difference is reported at the forward where it starts.

Data layout: ``engine_golden.json`` holds the cases, each with ``tracks = {arch: first track row}``
(member ``k`` is row ``first + k``); ``engine_golden.safetensors`` holds flat tensors (``TENSOR_KEYS``),
``index`` ``(tracks, len(TENSOR_KEYS), 2)`` (the [start, end) rows of each track in each) and
``logits`` ``(unique rows, vocab)``, the bit-for-bit deduplicated stored logits rows that
``logit_rows`` points into.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from helpers import left_pad, prompt
from safetensors.torch import load_file

import kvsieve
from kvsieve.transformers_adapter import cache_kwargs

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
JSON_PATH = DATA_DIR / "engine_golden.json"
TENSORS_PATH = DATA_DIR / "engine_golden.safetensors"
FORMAT = 1

BUDGET = 12
WINDOW = 4
BLOCK = 8
RATIO = 0.5
DECODE_STEPS = 4
DECODE_SCHEDULE_STEPS = 6
SHARED_STEPS = 3
TURN2_NEW_TOKENS = 10

#: Tolerance of the replayed logits (stored ones and the fingerprints of the others, which move by at most
#: as much as the logits do).
LOGITS_ATOL = 1e-6

ParamsFor = Callable[[int, str, dict[str, Any]], dict[str, Any]]

# ---------------------------------------------------------------------------------------------- grid


def _single(length: int, seed: int) -> dict[str, Any]:
    return {"rows": [[length, seed]], "padded": False}


def _padded(*rows: tuple[int, int]) -> dict[str, Any]:
    return {"rows": [list(r) for r in rows], "padded": True}


#: Prompts per kind (lengths 30–48, fixed seeds; padded rows of different lengths).
INPUTS: dict[str, dict[str, dict[str, Any]]] = {
    "prefill": {"b1": _single(40, 101), "pad": _padded((40, 102), (31, 103), (46, 104))},
    "ratio": {"b1": _single(44, 111), "pad": _padded((44, 112), (30, 113), (37, 114))},
    "decode": {"b1": _single(36, 121), "pad": _padded((36, 122), (30, 123), (41, 124))},
    "blockwise": {"b1": _single(45, 131), "pad": _padded((45, 132), (30, 133), (38, 134))},
    "turn2": {"pad": _padded((34, 142), (42, 143), (30, 144))},
    "shared": {"b1": _single(40, 151), "pad": _padded((48, 152), (33, 153), (39, 154))},
    "variant": {"pad": _padded((42, 162), (35, 163), (47, 164))},
}
TURN2_SEED = 145


#: Left out of the (slowest) block-wise second turn to keep the test under a minute: one CAOTE per base
#: family is enough there, and pyramid_restkv is restkv with pyramidkv's budgets (both are in).
TURN2_BLOCKWISE_SKIP = frozenset({"h2o_fastcaote", "tova_caote", "snapkv_fastcaote", "pyramid_restkv"})


def _program(steps: int) -> list[list[Any]]:
    return [["prompt"]] + [["decode"]] * steps


def _turn2_program() -> list[list[Any]]:
    return [["prompt"], ["decode"], ["decode"], ["extend", TURN2_NEW_TOKENS, TURN2_SEED], ["decode"], ["decode"]]


def policy_fields(name: str) -> set[str]:
    return set(kvsieve.list_policies()[name].parameters())


def fit_params(name: str, **params: Any) -> dict[str, Any]:
    """The grid's default parameters for ``name``: budget 12 (or ``params``), window 4 when it has one.

    Keys the policy does not accept are dropped; policies that need no budget (``full``) get none.
    """
    preset = kvsieve.list_policies()[name]
    needs_budget = preset.needs_budget
    accepted = policy_fields(name)
    out: dict[str, Any] = {}
    if needs_budget and "ratio" not in params:
        out["budget"] = BUDGET
    if "window" in accepted:
        out["window"] = WINDOW
    out.update(params)
    if not needs_budget:
        out.pop("budget", None)
    return {k: v for k, v in out.items() if k in accepted}


def _case(
    case_id: str,
    kind: str,
    members: list[tuple[str, dict[str, Any]]],
    inputs: dict[str, Any],
    program: list[list[Any]],
    shared: bool = False,
) -> dict[str, Any]:
    return {
        "id": case_id,
        "kind": kind,
        "shared": shared,
        "members": [{"policy": p, "params": params} for p, params in members],
        "inputs": inputs,
        "program": program,
    }


#: Parameter variants: (label, policy, params on top of the defaults of :func:`fit_params`).
VARIANTS: list[tuple[str, str, dict[str, Any]]] = [
    ("restkv-no_oproj", "restkv", {"use_output_projection": False}),
    ("restkv-no_ema", "restkv", {"use_ema": False}),
    ("restkv-no_aws", "restkv", {"adaptive_smoothing": False}),
    ("restkv-no_aws-k1", "restkv", {"adaptive_smoothing": False, "kernel_size": 1}),
    ("restkv-vatp", "restkv", {"indicator": "vatp"}),
    ("restkv-attention", "restkv", {"indicator": "attention"}),
    ("restkv-k1", "restkv", {"kernel_size": 1}),
    ("restkv-beta1", "restkv", {"beta": 1}),
    ("restkv-beta4-alpha0.7", "restkv", {"beta": 4, "alpha": 0.7}),
    ("restkv-window0", "restkv", {"window": 0}),
    ("snapkv-maxpool", "snapkv", {"pooling": "maxpool"}),
    ("snapkv-k7", "snapkv", {"kernel_size": 7}),
    ("snapkv-k1", "snapkv", {"kernel_size": 1}),
    ("snapkv-window0", "snapkv", {"window": 0}),
    ("snapkv-budget36", "snapkv", {"budget": 36}),
    ("pyramidkv-beta2", "pyramidkv", {"beta": 2}),
    ("pyramidkv-maxpool-k7", "pyramidkv", {"pooling": "maxpool", "kernel_size": 7}),
    ("adakv-base_h2o", "adakv", {"base": "h2o"}),
    ("adakv-base_tova", "adakv", {"base": "tova"}),
    ("adakv-base_restkv", "adakv", {"base": "restkv"}),
    ("adakv-base_streaming_llm", "adakv", {"base": "streaming_llm"}),
    ("adakv-base_h2o_caote", "adakv", {"base": "h2o_caote"}),
    ("adakv-alpha0.5", "adakv", {"alpha": 0.5}),
    ("adakv-alpha0", "adakv", {"alpha": 0.0}),
    ("h2o-recent0.25", "h2o", {"recent_ratio": 0.25}),
    ("h2o-recent0", "h2o", {"recent_ratio": 0.0}),
    ("h2o-budget36", "h2o", {"budget": 36}),
    ("streaming_llm-sinks2", "streaming_llm", {"sinks": 2}),
    ("streaming_llm-sinks0", "streaming_llm", {"sinks": 0}),
    ("random-seed3-window2", "random", {"seed": 3, "window": 2}),
    ("exact_topk-budget6", "exact_topk", {"budget": 6}),
    ("h2o_caote-recent0.25", "h2o_caote", {"recent_ratio": 0.25}),
    ("h2o_fastcaote-recent0.25", "h2o_fastcaote", {"recent_ratio": 0.25}),
    ("snapkv_caote-maxpool", "snapkv_caote", {"pooling": "maxpool"}),
    ("snapkv_fastcaote-k7", "snapkv_fastcaote", {"kernel_size": 7}),
    ("pyramid_restkv-pbeta2", "pyramid_restkv", {"pyramid_beta": 2}),
    ("pyramid_restkv-vatp", "pyramid_restkv", {"indicator": "vatp"}),
    ("ada_restkv-floor0.5", "ada_restkv", {"floor_alpha": 0.5}),
    ("ada_restkv-no_ema-k1", "ada_restkv", {"use_ema": False, "kernel_size": 1}),
]

#: Caches sharing one prefill (``prefill_shared``): every scoring family, an allocator, a selection
#: policy, a decode-schedule policy and the full cache.
SHARED_GROUP: list[tuple[str, dict[str, Any]]] = [
    ("full", {}),
    ("snapkv", {}),
    ("h2o", {}),
    ("restkv", {}),
    ("adakv", {}),
    ("tova_caote", {}),
    ("exact_topk", {"budget": 6}),
    ("h2o", {"schedule": "decode", "buffer": 2}),
]


def _built(name: str) -> kvsieve.Policy | None:
    """The preset with the grid's default parameters (None when those cannot build it, e.g. no gates)."""
    try:
        return kvsieve.make_policy(name, **fit_params(name))
    except (kvsieve.PolicyConfigError, ValueError, FileNotFoundError):
        return None


def build_cases() -> list[dict[str, Any]]:
    """Every candidate case (arch-independent); the recorder drops those that raise."""
    policies = {name: _built(name) for name in kvsieve.list_policies()}
    cases: list[dict[str, Any]] = []
    for name in policies:
        for tag in ("b1", "pad"):
            cases.append(
                _case(
                    f"prefill-{tag}-{name}",
                    "prefill",
                    [(name, fit_params(name))],
                    INPUTS["prefill"][tag],
                    _program(DECODE_STEPS),
                )
            )
    for name, cls in policies.items():
        if cls is None or not cls.evicts or "ratio" not in policy_fields(name):
            continue
        for tag in ("b1", "pad"):
            params = fit_params(name, ratio=RATIO)
            cases.append(
                _case(f"ratio-{tag}-{name}", "ratio", [(name, params)], INPUTS["ratio"][tag], _program(DECODE_STEPS))
            )
    for name, cls in policies.items():
        if cls is None or "decode" not in cls.schedules():
            continue
        for tag, buffer in (("b1", 0), ("b1", 3)):  # padded: turn2-pad-decode-*
            params = fit_params(name, schedule="decode", buffer=buffer)
            cases.append(
                _case(
                    f"decode-{tag}-buf{buffer}-{name}",
                    "decode",
                    [(name, params)],
                    INPUTS["decode"][tag],
                    _program(DECODE_SCHEDULE_STEPS),
                )
            )
    for name, cls in policies.items():
        if cls is None or "blockwise" not in cls.schedules():
            continue
        for tag in ("b1", "pad"):
            params = fit_params(name, schedule="blockwise", block_size=BLOCK)
            cases.append(
                _case(
                    f"blockwise-{tag}-{name}",
                    "blockwise",
                    [(name, params)],
                    INPUTS["blockwise"][tag],
                    _program(DECODE_STEPS),
                )
            )
    # Second turn (prefill, 2 steps, 10 new tokens, 2 steps) on the left-padded batch, under every schedule.
    for name, cls in policies.items():
        schedules = [("prefill", {})]
        if cls is None:
            continue
        if "decode" in cls.schedules():
            schedules.append(("decode", {"schedule": "decode", "buffer": 0}))
        if "blockwise" in cls.schedules() and name not in TURN2_BLOCKWISE_SKIP:
            schedules.append(("blockwise", {"schedule": "blockwise", "block_size": BLOCK}))
        for schedule, extra in schedules:
            cases.append(
                _case(
                    f"turn2-pad-{schedule}-{name}",
                    "turn2",
                    [(name, fit_params(name, **extra))],
                    INPUTS["turn2"]["pad"],
                    _turn2_program(),
                )
            )
    group = [(name, fit_params(name, **params)) for name, params in SHARED_GROUP if name in policies]
    for tag in ("b1", "pad"):
        cases.append(
            _case(f"shared-{tag}", "shared", group, INPUTS["shared"][tag], _program(SHARED_STEPS), shared=True)
        )
    # Variants on the left-padded batch only (batch-1 paths are covered by the default cases above).
    for label, name, params in VARIANTS:
        if name in policies:
            cases.append(
                _case(
                    f"variant-pad-{label}",
                    "variant",
                    [(name, fit_params(name, **params))],
                    INPUTS["variant"]["pad"],
                    _program(DECODE_STEPS),
                )
            )
    ids = [c["id"] for c in cases]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    return cases


# ---------------------------------------------------------------------------------------------- running


@dataclasses.dataclass
class Track:
    """What one cache went through: per point (forward), head lengths, kept positions and logits."""

    head_lengths: list[torch.Tensor] = dataclasses.field(default_factory=list)  # (layers, batch, kv_heads)
    positions: list[list[torch.Tensor]] = dataclasses.field(default_factory=list)  # (layer, b, h) order
    logits: list[torch.Tensor] = dataclasses.field(default_factory=list)  # last position, (batch, vocab)

    def record(self, cache: kvsieve.KVCache, last_logits: torch.Tensor) -> None:
        lengths = cache.head_lengths().clone()
        layers, batch, heads = lengths.shape
        self.head_lengths.append(lengths)
        self.positions.append(
            [cache.kept_positions(i, b, h) for i in range(layers) for b in range(batch) for h in range(heads)]
        )
        self.logits.append(last_logits.detach().float().clone())


def make_inputs(inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    rows = inputs["rows"]
    if not inputs["padded"]:
        assert len(rows) == 1
        ((length, seed),) = rows
        return prompt(batch=1, length=length, seed=seed), None
    ids, mask, _ = left_pad([prompt(length=length, seed=seed)[0] for length, seed in rows])
    return ids, mask


def _default_params(index: int, policy: str, params: dict[str, Any]) -> dict[str, Any]:
    return dict(params)


def run_case(
    model: torch.nn.Module,
    case: dict[str, Any],
    params_for: ParamsFor | None = None,
    forced_tokens: list[torch.Tensor] | None = None,
) -> list[Track]:
    """Run ``case`` on ``model``; one :class:`Track` per member.

    ``params_for(member_index, policy, params)`` returns the keyword arguments of the member's
    ``KVCache`` (default: the recorded ``params``). ``forced_tokens[member]`` ``(forwards, batch)``, when
    given, are fed at the decoding steps instead of the greedy tokens of this run (teacher forcing with
    the recorded tokens, so a difference is reported where it starts instead of cascading).
    """
    params_for = params_for or _default_params
    ids, mask = make_inputs(case["inputs"])
    batch = ids.shape[0]
    program = case["program"]
    caches = [
        kvsieve.KVCache(model, m["policy"], **params_for(i, m["policy"], m["params"]))
        for i, m in enumerate(case["members"])
    ]
    tracks = [Track() for _ in caches]
    start = 0
    if case["shared"]:
        assert program[0] == ["prompt"]
        kwargs: dict[str, Any] = {"logits_to_keep": 1}
        if mask is not None:
            kwargs["attention_mask"] = mask
        out = kvsieve.prefill_shared(model, ids, caches, **kwargs)
        for cache, track in zip(caches, tracks, strict=True):
            track.record(cache, out.logits[:, -1])
        start = 1
    for member, (cache, track) in enumerate(zip(caches, tracks, strict=True)):
        cur_mask = mask
        if start and cur_mask is not None:
            cur_mask = cur_mask.clone()
        for index in range(start, len(program)):
            op = program[index]
            if op[0] == "prompt":
                inp = ids
            elif op[0] == "decode":
                if forced_tokens is not None:
                    inp = forced_tokens[member][index - 1].to(torch.long).view(batch, 1)
                else:
                    inp = track.logits[-1].argmax(-1, keepdim=True)
            elif op[0] == "extend":
                inp = prompt(batch=batch, length=op[1], seed=op[2])
            else:
                raise ValueError(f"unknown op {op!r}")
            if op[0] != "prompt" and cur_mask is not None:
                cur_mask = torch.cat([cur_mask, torch.ones_like(inp)], dim=1)
            out = model(inp, attention_mask=cur_mask, **cache_kwargs(model, cache))
            track.record(cache, out.logits[:, -1])
    return tracks


# ---------------------------------------------------------------------------------------------- golden data


@dataclasses.dataclass
class Golden:
    """One recorded track."""

    head_lengths: torch.Tensor  # (forwards, layers, batch, kv_heads)
    positions: list[list[list[int]]]  # per forward, per (layer, b, h) in that order
    tokens: torch.Tensor  # (forwards, batch)
    fingerprints: torch.Tensor  # (forwards, batch, 4) float64
    logits: dict[int, torch.Tensor]  # forward index -> (batch, vocab) float32


#: Flat tensors of the safetensors file, in the column order of its ``index`` tensor.
TENSOR_KEYS = ("kept", "head_lengths", "logit_rows", "tokens", "fingerprints")


def sequence_length(case: dict[str, Any]) -> int:
    """Tokens seen by the end of the program (positions are absolute, so every kept one is below)."""
    width = max(length for length, _ in case["inputs"]["rows"])
    extra = sum(1 if op[0] == "decode" else op[1] for op in case["program"] if op[0] != "prompt")
    return width + extra


def _mask_bytes(case: dict[str, Any]) -> int:
    return -(-sequence_length(case) // 8)


def pack_positions(positions: list[torch.Tensor], nbytes: int) -> torch.Tensor:
    """Kept positions of every head (strictly ascending) → bitmasks ``(heads, nbytes)`` uint8."""
    bits = torch.zeros(len(positions), nbytes * 8, dtype=torch.bool)
    for k, p in enumerate(positions):
        p = p.to(torch.long)
        assert p.numel() == 0 or (int(p.min()) >= 0 and int(p.max()) < nbytes * 8), "position out of range"
        assert bool((p[1:] > p[:-1]).all()), "kept positions are not strictly ascending"
        bits[k, p] = True
    weights = 2 ** torch.arange(8)
    return (bits.view(len(positions), nbytes, 8).to(torch.long) * weights).sum(-1).to(torch.uint8)


def unpack_positions(masks: torch.Tensor) -> list[list[int]]:
    """Inverse of :func:`pack_positions`: ascending positions of every head."""
    bits = (masks.to(torch.long).unsqueeze(-1) >> torch.arange(8)) & 1
    bits = bits.reshape(masks.shape[0], -1).bool()
    return [torch.nonzero(row).flatten().tolist() for row in bits]


def fingerprint(logits: torch.Tensor) -> torch.Tensor:
    """(max, min, mean, logsumexp) of each row, in float64: each moves by ≤ ε when no logit moves by more."""
    x = logits.double()
    return torch.stack([x.max(-1).values, x.min(-1).values, x.mean(-1), torch.logsumexp(x, -1)], -1)


FINGERPRINT_NAMES = ("max", "min", "mean", "logsumexp")


def logit_points(program: list[list[Any]]) -> list[int]:
    """Forwards whose full last-position logits are stored: every multi-token forward and the last one."""
    return sorted({i for i, op in enumerate(program) if op[0] != "decode"} | {len(program) - 1})


def point_label(program: list[list[Any]], index: int) -> str:
    op = program[index][0]
    if op == "decode":
        return f"forward {index} (decode step {sum(1 for o in program[: index + 1] if o[0] == 'decode')})"
    return f"forward {index} ({op})"


def pack_tracks(entries: list[tuple[dict[str, Any], list[Track]]]) -> dict[str, torch.Tensor]:
    """Concatenate every track (``entries``: (case, tracks) in JSON track order) into flat tensors.

    ``index[track] = [[start, end] for each of TENSOR_KEYS]`` (rows of each flat tensor). Stored logits
    rows are deduplicated bit for bit into ``logits`` (the prompt forward's logits do not depend on the
    policy, except under ``blockwise``); ``logit_rows`` points into it.
    """
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in TENSOR_KEYS}
    offsets = dict.fromkeys(TENSOR_KEYS, 0)
    index = []
    unique: dict[bytes, int] = {}
    table: list[torch.Tensor] = []

    def row_id(row: torch.Tensor) -> int:
        key = row.numpy().tobytes()
        if key not in unique:
            unique[key] = len(table)
            table.append(row)
        return unique[key]

    for case, tracks in entries:
        nbytes, points = _mask_bytes(case), logit_points(case["program"])
        for track in tracks:
            for lengths, point in zip(track.head_lengths, track.positions, strict=True):
                assert [len(p) for p in point] == lengths.reshape(-1).tolist(), "head_lengths ≠ kept positions"
            stored = torch.cat([track.logits[i] for i in points]).to(torch.float32)
            row = {
                "kept": torch.cat([pack_positions(point, nbytes) for point in track.positions]).reshape(-1),
                "head_lengths": torch.stack(track.head_lengths).reshape(-1).to(torch.uint8),
                "logit_rows": torch.tensor([row_id(r) for r in stored], dtype=torch.int32),
                "tokens": torch.stack([lg.argmax(-1) for lg in track.logits]).reshape(-1).to(torch.int16),
                "fingerprints": torch.stack([fingerprint(lg) for lg in track.logits]).reshape(-1, 4),
            }
            assert torch.equal(row["head_lengths"].long(), torch.stack(track.head_lengths).reshape(-1))
            spans = []
            for key in TENSOR_KEYS:
                parts[key].append(row[key])
                spans.append([offsets[key], offsets[key] + row[key].shape[0]])
                offsets[key] += row[key].shape[0]
            index.append(spans)
    out = {k: torch.cat(v).contiguous() for k, v in parts.items()}
    out["logits"] = torch.stack(table).contiguous()
    out["index"] = torch.tensor(index, dtype=torch.int64)
    return out


def load_golden() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    meta = json.loads(JSON_PATH.read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{JSON_PATH}: format {meta.get('format')!r}, expected {FORMAT}")
    return meta, load_file(str(TENSORS_PATH))


def golden_tracks(
    meta: dict[str, Any], tensors: dict[str, torch.Tensor], case: dict[str, Any], arch: str
) -> list[Golden]:
    """The recorded tracks of ``case`` on ``arch``, one per member."""
    shape = meta["arch_shapes"][arch]
    layers, heads = shape["layers"], shape["kv_heads"]
    batch = len(case["inputs"]["rows"])
    forwards = len(case["program"])
    points = logit_points(case["program"])
    nbytes = _mask_bytes(case)
    out = []
    for member in range(len(case["members"])):
        spans = tensors["index"][case["tracks"][arch] + member].tolist()
        piece = {k: tensors[k][a:b] for k, (a, b) in zip(TENSOR_KEYS, spans, strict=True)}
        per_point = layers * batch * heads
        kept = unpack_positions(piece["kept"].view(forwards * per_point, nbytes))
        logits = tensors["logits"][piece["logit_rows"].to(torch.long)].view(len(points), batch, -1)
        out.append(
            Golden(
                head_lengths=piece["head_lengths"].to(torch.long).view(forwards, layers, batch, heads),
                positions=[kept[i * per_point : (i + 1) * per_point] for i in range(forwards)],
                tokens=piece["tokens"].to(torch.long).view(forwards, batch),
                fingerprints=piece["fingerprints"].view(forwards, batch, 4),
                logits={p: logits[i] for i, p in enumerate(points)},
            )
        )
    return out


def compare(case: dict[str, Any], expected: list[Golden], got: list[Track], max_report: int = 12) -> list[str]:
    """Every difference between the recorded and the replayed tracks, as readable lines (empty: equal)."""
    problems: list[str] = []
    program = case["program"]
    max_diff = 0.0
    for member, (exp, run) in enumerate(zip(expected, got, strict=True)):
        who = f"member {member} ({case['members'][member]['policy']})" if len(expected) > 1 else "cache"
        if len(run.logits) != len(program):
            problems.append(f"{who}: {len(run.logits)} forwards ran, expected {len(program)}")
            continue
        layers, batch, heads = exp.head_lengths.shape[1:]
        for i in range(len(program)):
            where = f"{who}, after {point_label(program, i)}"
            lengths = run.head_lengths[i].to(torch.long)
            if tuple(lengths.shape) != (layers, batch, heads):
                problems.append(f"{where}: head_lengths shape {tuple(lengths.shape)} != {(layers, batch, heads)}")
                continue
            if not torch.equal(lengths, exp.head_lengths[i]):
                problems.append(
                    f"{where}: head_lengths differ\n    expected {exp.head_lengths[i].tolist()}\n"
                    f"    got      {lengths.tolist()}"
                )
            k = 0
            for layer in range(layers):
                for b in range(batch):
                    for h in range(heads):
                        want, have = exp.positions[i][k], run.positions[i][k].tolist()
                        k += 1
                        if want != have:
                            problems.append(
                                f"{where}: kept positions of (layer {layer}, row {b}, kv head {h}) differ\n"
                                f"    expected {want}\n    got      {have}"
                            )
            logits = run.logits[i]
            if logits.dim() != 2 or logits.shape[0] != batch:
                problems.append(f"{where}: logits shape {tuple(logits.shape)}")
                continue
            tokens = logits.argmax(-1).tolist()
            if tokens != exp.tokens[i].tolist():
                problems.append(f"{where}: greedy tokens {tokens} != recorded {exp.tokens[i].tolist()}")
            fp_diff = (fingerprint(logits) - exp.fingerprints[i]).abs().amax(0)
            for name, diff in zip(FINGERPRINT_NAMES, fp_diff.tolist(), strict=True):
                max_diff = max(max_diff, diff)
                if not diff <= LOGITS_ATOL:
                    problems.append(f"{where}: logits {name} differs by {diff:.3g} > atol {LOGITS_ATOL}")
            if i in exp.logits:
                diff = float((logits.float() - exp.logits[i]).abs().max())
                max_diff = max(max_diff, diff)
                if not diff <= LOGITS_ATOL:
                    problems.append(f"{where}: max |Δ logits| = {diff:.3g} > atol {LOGITS_ATOL}")
    if problems:
        more = len(problems) - max_report
        problems = problems[:max_report] + ([f"... and {more} more differences"] if more > 0 else [])
        problems.append(f"max |Δ| over stored logits and fingerprints: {max_diff:.3g}")
    return problems
