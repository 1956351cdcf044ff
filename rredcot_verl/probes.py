"""Values of segment-boundary states of one trace, scored with the policy model itself (no grad).

A *probe* is a token sequence appended after the prefix ``prompt + response[:b]``; its ``scored_ids`` are
scored by the model's log-probability and its ``forced_ids`` (e.g. the exit text ``"\\n</think>\\n\\\\boxed"``) only
condition them. Probes feed three value sources (``ProbeSettings.value_source``):

* ``exit_probe``: probability of the correct answer(s) after a forced exit from thinking at the boundary;
* ``reference_continuation``: probability of a bank of known continuations (reference solution remainder,
  group's correct traces) from the boundary;
* ``own_continuation``: ζ times the probability of the trace's own remainder, read from the trace log-probs
  (no probes; a baseline).

Scoring has two paths with the same result:

* ``score_probes_naive``: one forward per probe over ``prompt + response[:b] + forced + scored`` (the reference);
* ``score_probes_packed``: the trace runs once with ``use_cache=True`` (this pass also gives the per-token
  log-probs and entropies of the response, i.e. verl's log-prob pass), then all probes run in ONE forward against
  that KV cache, with a (probe tokens × (trace + probe tokens)) additive mask from ``build_probe_mask`` and
  per-probe position ids restarting at the probe's prefix length.

Position convention: ``P`` = prompt length (≥ 1), ``L`` = response length (≥ 0), a probe at boundary ``b``
(0 ≤ b ≤ L) continues the prefix of length ``P + b``. Probes whose ``P + b + len(forced) + len(scored)`` exceeds
``max_positions`` are skipped: their log-prob is NaN and they are counted, so the caller can fall back.

This module imports neither verl nor ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

VALUE_SOURCES = ("exit_probe", "reference_continuation", "own_continuation")
NORMALIZATIONS = ("raw", "self_normalized")
KIND_CORRECT = "correct"
KIND_INCORRECT = "incorrect"  # scored only for the self-normalising denominator
PROBE_KINDS = (KIND_CORRECT, KIND_INCORRECT)


@dataclass(frozen=True)
class ProbeSettings:
    """How segment-boundary values are estimated.

    Attributes:
        value_source: one of ``VALUE_SOURCES``. Default ``"exit_probe"`` (the paper's answer-forcing probe). On small
            models and tasks with steps, ``"reference_continuation"`` was measured to be far more informative
            (DESIGN.md, "Which value source"); the task's recipe picks it.
        normalization: ``"self_normalized"`` (default; probability of the correct answers divided by the mass of all
            answers the group produced, a calibrated value in [0, 1]) or ``"raw"`` (the plain sum, a lower bound).
        exit_text: text forced before exit-probe answers; the caller tokenizes it.
    """

    value_source: str = "exit_probe"
    normalization: str = "self_normalized"
    exit_text: str = "\n</think>\n\\boxed"

    def __post_init__(self) -> None:
        if self.value_source not in VALUE_SOURCES:
            raise ValueError(f"value_source must be one of {VALUE_SOURCES}, got {self.value_source!r}")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}")
        if self.value_source == "exit_probe" and not self.exit_text:
            raise ValueError("exit_text must be non-empty for value_source='exit_probe'")


@dataclass(frozen=True)
class Probe:
    """One scored continuation of the prefix ``prompt + response[:boundary]``.

    Attributes:
        boundary: number of response tokens in the prefix, 0 ≤ boundary ≤ L.
        forced_ids: conditioning tokens placed after the prefix, not scored (may be empty).
        scored_ids: tokens whose log-probability is summed (non-empty).
        group: index of the value this probe contributes to (e.g. the boundary index k).
        kind: ``"correct"`` (counted in the value) or ``"incorrect"`` (only in the self-normalising denominator).
    """

    boundary: int
    forced_ids: tuple[int, ...]
    scored_ids: tuple[int, ...]
    group: int
    kind: str = KIND_CORRECT

    def __post_init__(self) -> None:
        object.__setattr__(self, "forced_ids", tuple(int(t) for t in self.forced_ids))
        object.__setattr__(self, "scored_ids", tuple(int(t) for t in self.scored_ids))
        if not self.scored_ids:
            raise ValueError(f"Probe.scored_ids must be non-empty (boundary={self.boundary}, group={self.group})")
        if self.boundary < 0:
            raise ValueError(f"Probe.boundary must be >= 0, got {self.boundary}")
        if self.group < 0:
            raise ValueError(f"Probe.group must be >= 0, got {self.group}")
        if self.kind not in PROBE_KINDS:
            raise ValueError(f"Probe.kind must be one of {PROBE_KINDS}, got {self.kind!r}")

    @property
    def tokens(self) -> tuple[int, ...]:
        """forced + scored, the text appended after the prefix."""
        return self.forced_ids + self.scored_ids


@dataclass
class PackedScores:
    """Output of ``score_probes_packed`` for one trace.

    Attributes:
        probe_logp: (n_probes,) fp32, Σ log π(scored | prefix, forced, earlier scored); NaN for skipped probes.
        trace_log_probs: (L,) fp32, log π(response[t] | prompt, response[:t]); None if not requested.
        trace_entropy: (L,) fp32, entropy of the next-token distribution predicting response[t]; None if not requested.
        num_skipped: number of probes skipped because they exceed ``max_positions``.
    """

    probe_logp: torch.Tensor
    trace_log_probs: torch.Tensor | None
    trace_entropy: torch.Tensor | None
    num_skipped: int


# ----------------------------------------------------------------------------------------------------------------
# Input checks


def _check_ids(name: str, ids: torch.Tensor, *, allow_empty: bool) -> None:
    if not isinstance(ids, torch.Tensor) or ids.dim() != 1:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"{name} must be a 1D tensor of token ids, got {shape}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    if not allow_empty and ids.numel() == 0:
        raise ValueError(f"{name} must be non-empty")


def _check_inputs(model, prompt_ids: torch.Tensor, response_ids: torch.Tensor, probes: Sequence[Probe]) -> None:
    _check_ids("prompt_ids", prompt_ids, allow_empty=False)  # the first response token needs a predictor
    _check_ids("response_ids", response_ids, allow_empty=True)
    response_len = response_ids.numel()
    for index, probe in enumerate(probes):
        if not isinstance(probe, Probe):
            raise ValueError(f"probes[{index}] must be a Probe, got {type(probe).__name__}")
        if probe.boundary > response_len:
            raise ValueError(
                f"probes[{index}].boundary={probe.boundary} is out of range for a response of {response_len} tokens"
            )
    layer_types = getattr(model.config, "layer_types", None) or ()
    if any(layer_type != "full_attention" for layer_type in layer_types):
        # The probe mask is passed to every layer; sliding-window layers would need their own mask.
        raise ValueError(f"probe scoring supports full-attention models only, got layer_types={layer_types}")


def _fits(probe: Probe, prompt_len: int, max_positions: int | None) -> bool:
    return max_positions is None or prompt_len + probe.boundary + len(probe.tokens) <= max_positions


# ----------------------------------------------------------------------------------------------------------------
# Reference path


@torch.no_grad()
def score_probes_naive(
    model,
    prompt_ids: torch.Tensor,
    response_ids: torch.Tensor,
    probes: Sequence[Probe],
    *,
    max_positions: int | None = None,
) -> torch.Tensor:
    """Score each probe with its own forward pass over ``prompt + response[:b] + forced + scored``.

    Args:
        model: a causal LM returning ``.logits`` (B, T, V).
        prompt_ids: (P,) token ids, P ≥ 1.
        response_ids: (L,) token ids, L ≥ 0.
        probes: n_probes probes with 0 ≤ boundary ≤ L.
        max_positions: position budget (the model's max_position_embeddings); longer probes are skipped.

    Returns:
        (n_probes,) fp32: Σ log π(scored tokens | everything before); NaN for skipped probes.
    """
    _check_inputs(model, prompt_ids, response_ids, probes)
    device = model.get_input_embeddings().weight.device
    prompt_len = prompt_ids.numel()
    scores = torch.full((len(probes),), float("nan"), dtype=torch.float32)
    for index, probe in enumerate(probes):
        if not _fits(probe, prompt_len, max_positions):
            continue
        tokens = torch.cat(
            [prompt_ids.long(), response_ids[: probe.boundary].long(), torch.tensor(probe.tokens, dtype=torch.long)]
        ).to(device)
        log_probs = model(input_ids=tokens[None]).logits[0].float().log_softmax(-1)
        first_scored = tokens.numel() - len(probe.scored_ids)
        positions = torch.arange(first_scored, tokens.numel(), device=device)
        scores[index] = log_probs[positions - 1, tokens[positions]].sum().cpu()
    return scores


# ----------------------------------------------------------------------------------------------------------------
# Packed path


def build_probe_mask(
    prefix_lengths: torch.Tensor, parents: torch.Tensor, cache_length: int, dtype: torch.dtype
) -> torch.Tensor:
    """Additive attention mask for the probe-tree tokens run against a cached trace.

    Probe tokens form a forest (probes at the same boundary share their common leading tokens, e.g. the exit
    text). Token i sees the cached positions < prefix_lengths[i] and its ancestors in the forest and itself.
    This is the one place that knows the mask's layout, so a block-mask backend (flex_attention) can replace it.

    Args:
        prefix_lengths: (T,) long, P + b of the probe tree token i belongs to.
        parents: (T,) long, index of token i's parent token, -1 for a tree root; a parent precedes its child.
        cache_length: number of cached positions (P + L).
        dtype: the model's activation dtype.

    Returns:
        (1, 1, T, cache_length + T): 0 where attention is allowed, the dtype's minimum elsewhere.
    """
    device = prefix_lengths.device
    total = parents.numel()
    sees_cache = torch.arange(cache_length, device=device)[None, :] < prefix_lengths[:, None]
    sees_probe = torch.eye(total, dtype=torch.bool, device=device)
    # Depth by depth (a handful of levels for answer probes), each token inherits its parent's ancestors.
    depth = []
    for parent in parents.tolist():
        depth.append(depth[parent] + 1 if parent >= 0 else 0)
    depth = torch.tensor(depth, dtype=torch.long, device=device)
    for level in range(1, int(depth.max()) + 1 if total else 0):
        children = torch.nonzero(depth == level)[:, 0]
        sees_probe[children] |= sees_probe[parents[children]]
    allowed = torch.cat([sees_cache, sees_probe], dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def _token_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(N, V) logits, (N,) targets → (N,) fp32 log-probs, without materialising the full log-softmax."""
    logits = logits.float()
    return logits.gather(-1, targets[:, None])[:, 0] - logits.logsumexp(-1)


def _trace_pass(model, prompt_ids, response_ids, *, use_cache: bool, needed_positions: torch.Tensor | None):
    """One forward over prompt + response; logits only where needed.

    With ``needed_positions`` None, keeps the logits at positions P-1 .. P+L-1 (L+1 rows: the L response
    predictions and the prediction after the last token). Otherwise keeps exactly ``needed_positions``.
    """
    device = model.get_input_embeddings().weight.device
    tokens = torch.cat([prompt_ids.long(), response_ids.long()]).to(device)
    keep = response_ids.numel() + 1 if needed_positions is None else needed_positions.to(device)
    output = model(input_ids=tokens[None], use_cache=use_cache, logits_to_keep=keep)
    return output.logits[0], output.past_key_values


def _log_probs_and_entropy(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, V) logits, (L,) targets → per-token log-prob and entropy (L,), fp32 (what verl's log-prob pass gives)."""
    logits = logits.float()
    log_norm = logits.logsumexp(-1)
    log_probs = logits.gather(-1, targets[:, None])[:, 0] - log_norm
    entropy = log_norm - (logits.softmax(-1) * logits).sum(-1)
    return log_probs, entropy


@torch.no_grad()
def trace_log_probs_and_entropy(
    model, prompt_ids: torch.Tensor, response_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain log-prob pass over one trace (no probes, no cache): the baseline the probe cost is measured against.

    Returns:
        log_probs (L,), entropy (L,), fp32.
    """
    _check_inputs(model, prompt_ids, response_ids, ())
    logits, _ = _trace_pass(model, prompt_ids, response_ids, use_cache=False, needed_positions=None)
    targets = response_ids.long().to(logits.device)
    log_probs, entropy = _log_probs_and_entropy(logits[:-1], targets)
    return log_probs.cpu(), entropy.cpu()


@torch.no_grad()
def score_probes_packed(
    model,
    prompt_ids: torch.Tensor,
    response_ids: torch.Tensor,
    probes: Sequence[Probe],
    *,
    return_trace_stats: bool = True,
    max_positions: int | None = None,
) -> PackedScores:
    """Score all probes of one trace with one cached trace pass plus one packed probe pass.

    A probe's text ``forced + scored`` (length n) enters the probe pass as its first n-1 tokens at positions
    P+b .. P+b+n-2 (the last token only needs to be predicted); probes at the same boundary share the tokens of
    their common leading text. The first probe token is predicted by the trace pass at position P+b-1, so a probe
    with empty ``forced_ids`` reads its first scored log-prob from there.

    Args:
        model: a causal LM (transformers, full attention) accepting a 4D additive ``attention_mask``,
            ``position_ids``, ``past_key_values`` and ``logits_to_keep``; eager and sdpa both work.
        prompt_ids: (P,) token ids, P ≥ 1.
        response_ids: (L,) token ids, L ≥ 0.
        probes: n_probes probes with 0 ≤ boundary ≤ L.
        return_trace_stats: also return the response's log-probs and entropies (the trace pass computes them).
        max_positions: position budget; probes with P + b + len(forced) + len(scored) > max_positions are skipped.

    Returns:
        PackedScores with probe_logp (n_probes,), trace_log_probs (L,), trace_entropy (L,), num_skipped.
    """
    _check_inputs(model, prompt_ids, response_ids, probes)
    device = model.get_input_embeddings().weight.device
    prompt_len, response_len = prompt_ids.numel(), response_ids.numel()
    kept = [i for i, probe in enumerate(probes) if _fits(probe, prompt_len, max_positions)]
    kept_probes = [probes[i] for i in kept]
    with_input = [probe for probe in kept_probes if len(probe.tokens) > 1]
    if not kept_probes and not return_trace_stats:
        return PackedScores(torch.full((len(probes),), float("nan")), None, None, num_skipped=len(probes))

    # Probes without forced ids read their first scored token's log-prob from the trace pass, at position P+b-1.
    reads_trace = [j for j, probe in enumerate(kept_probes) if not probe.forced_ids]
    read_positions = torch.tensor([prompt_len + kept_probes[j].boundary - 1 for j in reads_trace], dtype=torch.long)
    # The trace pass keeps logits for positions P-1 .. P+L-1 when the trace stats are wanted, else only those read.
    needed = None if return_trace_stats else torch.unique(read_positions)
    trace_logits, cache = _trace_pass(
        model, prompt_ids, response_ids, use_cache=bool(with_input), needed_positions=needed
    )
    trace_log_probs = trace_entropy = None
    if return_trace_stats:
        targets = response_ids.long().to(device)
        trace_log_probs, trace_entropy = _log_probs_and_entropy(trace_logits[:-1], targets)
        trace_log_probs, trace_entropy = trace_log_probs.cpu(), trace_entropy.cpu()
        read_rows = read_positions - (prompt_len - 1)
    else:
        read_rows = torch.searchsorted(needed, read_positions)

    kept_logp = torch.zeros(len(kept_probes), dtype=torch.float32)
    if reads_trace:
        targets = torch.tensor([kept_probes[j].scored_ids[0] for j in reads_trace], device=device)
        kept_logp[reads_trace] = _token_log_probs(trace_logits[read_rows.to(device)], targets).cpu()

    if with_input:
        kept_logp += _probe_pass(model, cache, prompt_len + response_len, prompt_len, kept_probes)

    probe_logp = torch.full((len(probes),), float("nan"), dtype=torch.float32)
    probe_logp[kept] = kept_logp
    return PackedScores(probe_logp, trace_log_probs, trace_entropy, num_skipped=len(probes) - len(kept))


def _probe_pass(model, cache, cache_length: int, prompt_len: int, probes: Sequence[Probe]) -> torch.Tensor:
    """One forward of all probes' input tokens against the trace cache.

    Probes at the same boundary are merged into a token tree (shared leading tokens run once), so K·|C| exit
    probes cost K·(|exit| + |C|·(|answer| - 1)) probe tokens instead of K·|C|·(a - 1).

    Returns (n_probes,) fp32: Σ of the scored log-probs predicted inside the probe pass (all but a probe's first
    token when it has no forced ids; those come from the trace pass).
    """
    device = model.get_input_embeddings().weight.device
    node_of = {}  # (boundary, parent node, token) → node index
    input_ids, position_ids, prefix_lengths, parents = [], [], [], []
    logit_nodes, targets, owners = [], [], []
    for j, probe in enumerate(probes):
        tokens = probe.tokens
        start = prompt_len + probe.boundary
        parent = -1
        for i, token in enumerate(tokens[:-1]):
            key = (probe.boundary, parent, token)
            if key not in node_of:
                node_of[key] = len(input_ids)
                input_ids.append(token)
                position_ids.append(start + i)
                prefix_lengths.append(start)
                parents.append(parent)
            parent = node_of[key]
            # Node i predicts tokens[i + 1]; it counts when that token is scored (index ≥ len(forced)).
            if i + 1 >= len(probe.forced_ids):
                logit_nodes.append(parent)
                targets.append(tokens[i + 1])
                owners.append(j)

    dtype = model.get_input_embeddings().weight.dtype
    mask = build_probe_mask(
        torch.tensor(prefix_lengths, device=device), torch.tensor(parents, device=device), cache_length, dtype
    )
    kept_nodes, row_of_target = torch.unique(torch.tensor(logit_nodes), return_inverse=True)
    output = model(
        input_ids=torch.tensor(input_ids, device=device)[None],
        position_ids=torch.tensor(position_ids, device=device)[None],
        attention_mask=mask,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=kept_nodes.to(device),
    )
    # DynamicCache.update concatenates into new tensors, so the trace's K/V were not written to; cropping leaves
    # the cache holding the trace alone again.
    cache.crop(-len(input_ids))
    token_logp = _token_log_probs(output.logits[0, row_of_target.to(device)], torch.tensor(targets, device=device))
    return torch.zeros(len(probes), dtype=torch.float32).index_add_(0, torch.tensor(owners), token_logp.cpu())


def score_batch_packed(
    model,
    prompt_ids: Sequence[torch.Tensor],
    response_ids: Sequence[torch.Tensor],
    probes: Sequence[Sequence[Probe]],
    *,
    return_trace_stats: bool = True,
    max_positions: int | None = None,
) -> list[PackedScores]:
    """``score_probes_packed`` over a batch of traces (a loop; traces have different lengths and probe sets).

    Args:
        prompt_ids, response_ids, probes: one entry per trace, as in ``score_probes_packed``.
    """
    if not len(prompt_ids) == len(response_ids) == len(probes):
        raise ValueError(
            f"batch sizes differ: {len(prompt_ids)} prompts, {len(response_ids)} responses, {len(probes)} probe lists"
        )
    return [
        score_probes_packed(
            model, prompt, response, trace_probes, return_trace_stats=return_trace_stats, max_positions=max_positions
        )
        for prompt, response, trace_probes in zip(prompt_ids, response_ids, probes)
    ]


# ----------------------------------------------------------------------------------------------------------------
# Value sources


def _distinct(sequences: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """Exact-duplicate removal keeping order: each distinct sequence is counted once in a sum of probabilities."""
    return list(dict.fromkeys(tuple(int(t) for t in sequence) for sequence in sequences))


def build_exit_probes(
    boundaries: Sequence[int],
    exit_ids: Sequence[int],
    correct_answers: Sequence[Sequence[int]],
    *,
    thinking_length: int,
    all_answers: Sequence[Sequence[int]] = (),
) -> list[Probe]:
    """Exit probes: at each boundary inside the thinking part, force the exit text and score each answer.

    Value k is Σ_{y ∈ correct} p(y | prefix_k, exit) (``"raw"``, a lower bound on the exit accuracy) or that sum
    divided by the mass of all distinct answers (``"self_normalized"``); see ``values_from_probe_logp``.

    Args:
        boundaries: (K,) response-token counts b_k; probe group k belongs to boundaries[k].
        exit_ids: tokenization of the exit text (e.g. "\\n</think>\\n\\\\boxed"), non-empty.
        correct_answers: token lists of the distinct correct answers (e.g. "{59}" + EOS), at least one.
        thinking_length: number of response tokens before the exit; boundaries beyond it get no probes
            (their value is NaN: the caller anchors or falls back there).
        all_answers: token lists of every distinct answer the group produced, for self-normalisation; answers not
            in ``correct_answers`` become ``"incorrect"`` probes (the denominator is correct ∪ all).

    Returns:
        Probes grouped by boundary index.
    """
    if not exit_ids:
        raise ValueError("exit_ids must be non-empty")
    correct = _distinct(correct_answers)
    if not correct:
        raise ValueError("correct_answers must hold at least one answer")
    incorrect = [answer for answer in _distinct(all_answers) if answer not in set(correct)]
    labelled = [(answer, KIND_CORRECT) for answer in correct] + [(answer, KIND_INCORRECT) for answer in incorrect]
    return [
        Probe(boundary=int(b), forced_ids=tuple(exit_ids), scored_ids=answer, group=k, kind=kind)
        for k, b in enumerate(boundaries)
        if b <= thinking_length
        for answer, kind in labelled
    ]


def build_reference_probes(
    boundaries: Sequence[int],
    continuations: Sequence[Sequence[Sequence[int]]],
    *,
    forced_ids: Sequence[int] = (),
) -> list[Probe]:
    """Reference-continuation probes: score the bank of known continuations from each boundary.

    Value k is Σ over the distinct bank entries of p(continuation | prefix_k, forced): a lower bound on the
    probability of reaching a correct answer, since the bank holds only some of the correct continuations.

    Args:
        boundaries: (K,) response-token counts b_k.
        continuations: per boundary k, the token lists of its bank (e.g. the reference solution's remaining steps
            and answer aligned to the step prefix k reached, and/or remainders of the group's correct traces).
            An empty bank gives that value NaN.
        forced_ids: optional conditioning text before every continuation (e.g. an exit text).

    Returns:
        Probes grouped by boundary index.
    """
    if len(continuations) != len(boundaries):
        raise ValueError(f"got {len(continuations)} continuation banks for {len(boundaries)} boundaries")
    return [
        Probe(boundary=int(b), forced_ids=tuple(forced_ids), scored_ids=continuation, group=k)
        for k, (b, bank) in enumerate(zip(boundaries, continuations))
        for continuation in _distinct(bank)
    ]


def values_from_probe_logp(
    probe_logp: torch.Tensor, probes: Sequence[Probe], num_values: int, normalization: str
) -> torch.Tensor:
    """Aggregate probe log-probs into values, in probability space via logsumexp.

    ``"raw"``: v_g = Σ_{correct probes of g} p.
    ``"self_normalized"``: v_g = Σ_correct p / Σ_{correct ∪ incorrect} p.
    Sums of distinct, prefix-free sequences stay ≤ 1; overlapping bank entries could exceed it, so values are clamped.

    Args:
        probe_logp: (n_probes,) from a scorer; NaN marks a skipped probe.
        probes: the n_probes probes.
        num_values: number of groups (values) V.
        normalization: ``"raw"`` or ``"self_normalized"``.

    Returns:
        (V,) fp32 in [0, 1]. NaN where a group has no correct probe or any of its probes was skipped: there is no
        estimate and the caller must fall back (e.g. to the anchored endpoint values).
    """
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    if probe_logp.shape != (len(probes),):
        raise ValueError(f"probe_logp has shape {tuple(probe_logp.shape)}, expected ({len(probes)},)")
    if any(probe.group >= num_values for probe in probes):
        raise ValueError(f"a probe's group is >= num_values={num_values}")
    logp = probe_logp.float().cpu()
    groups = torch.tensor([probe.group for probe in probes], dtype=torch.long)
    is_correct = torch.tensor([probe.kind == KIND_CORRECT for probe in probes], dtype=torch.bool)
    in_denominator = is_correct if normalization == "raw" else torch.ones_like(is_correct)

    def group_logsumexp(selected: torch.Tensor) -> torch.Tensor:
        per_group = torch.full((num_values, max(len(probes), 1)), float("-inf"))
        index = torch.nonzero(selected)[:, 0]
        per_group[groups[index], index] = logp[index].nan_to_num(nan=float("-inf"))
        return per_group.logsumexp(-1)

    log_values = group_logsumexp(is_correct)
    if normalization == "self_normalized":
        log_values = log_values - group_logsumexp(in_denominator)
    values = log_values.exp().clamp(max=1.0)
    has_correct = torch.zeros(num_values, dtype=torch.bool)
    has_correct[groups[is_correct]] = True
    skipped = torch.zeros(num_values, dtype=torch.bool)
    skipped[groups[logp.isnan() & in_denominator]] = True
    return values.masked_fill(~has_correct | skipped, float("nan"))


def own_continuation_values(trace_log_probs: torch.Tensor, boundaries: Sequence[int], outcome: float) -> torch.Tensor:
    """Own-continuation baseline: v_k = ζ · Π_{n ≥ b_k} π(o_n | o_<n), from the trace log-probs alone.

    A one-sample lower bound; ~0 for long traces and 0 for every incorrect trace (research/rredcot.md §3.4).

    Args:
        trace_log_probs: (L,) log π(response[n] | prompt, response[:n]).
        boundaries: (K,) response-token counts, 0 ≤ b_k ≤ L.
        outcome: ζ ∈ [0, 1], the trace's verified reward.

    Returns:
        (K,) fp32 in [0, 1].
    """
    if trace_log_probs.dim() != 1:
        raise ValueError(f"trace_log_probs must be 1D (L,), got shape {tuple(trace_log_probs.shape)}")
    if not 0.0 <= outcome <= 1.0:
        raise ValueError(f"outcome must be in [0, 1], got {outcome}")
    response_len = trace_log_probs.numel()
    bounds = torch.as_tensor(list(boundaries), dtype=torch.long)
    if bounds.numel() and (bounds.min() < 0 or bounds.max() > response_len):
        raise ValueError(f"boundaries must lie in [0, {response_len}], got {bounds.tolist()}")
    # suffix[n] = Σ_{m ≥ n} log p_m, with suffix[L] = 0.
    suffix = torch.cat([trace_log_probs.float().flip(0).cumsum(0).flip(0), torch.zeros(1)])
    return outcome * suffix[bounds].exp()
