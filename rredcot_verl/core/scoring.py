"""Packed scoring: the log-probabilities of every probe of a batch of traces, one forward per micro-batch (no grad).

``score_batch_packed`` (and ``score_probes_packed`` for one trace) packs traces into micro-batches by a token budget;
each micro-batch is ONE forward over every row's trace followed by its probes' tokens, merged into a token tree per
boundary. The trace tokens attend causally; the probe tokens attend with a (probe tokens × (trace + probe tokens))
mask from ``build_probe_mask`` (run block by block where a row's probes cut into one block per boundary, as long
continuations do: ``_probe_blocks``) and per-probe position ids restarting at the probe's prefix length. Log-probs
are computed from the final hidden states only where they are read. The same forward gives the per-token log-probs and
entropies of the response (verl's log-prob pass) when asked. ``benchmarks/reference_scorers.py`` holds the
one-forward-per-probe reference it is tested against.

Probes whose ``P + b + len(forced) + len(scored)`` exceeds ``max_positions`` are skipped: their log-prob is NaN and
they are counted, so the caller can fall back.

This module imports neither verl nor ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rredcot_verl.core.model_support import LogitTransform, logit_transform, value_pass_refusal
from rredcot_verl.core.probes import Probe

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


def check_inputs(prompt_ids: torch.Tensor, response_ids: torch.Tensor, probes: Sequence[Probe]) -> None:
    """Raise ValueError on ids that are not 1-D integer tensors or probes past the response."""
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


def probe_fits(probe: Probe, prompt_len: int, max_positions: int | None) -> bool:
    """Whether the probe's last token lies within the model's positions."""
    return max_positions is None or prompt_len + probe.boundary + len(probe.tokens) <= max_positions


# ----------------------------------------------------------------------------------------------------------------
# Packed path
#
# One forward per micro-batch of traces. Row r of a micro-batch holds its trace (prompt + response, right-padded to
# T) followed by its probe-tree tokens (right-padded to Tp): input (B, T + Tp). The value-pass attention function
# (registered below) attends the first T queries causally (the trace: padding sits after every real token, so it is
# never seen) and the last Tp queries with the probe mask (B, 1, Tp, T + Tp), block by block where the forward's
# ``probe_blocks`` keyword gives the blocks. No KV cache is kept (memory ≈ a plain forward over T + Tp tokens), and
# the model is called once per micro-batch, which is what FSDP2's per-forward all-gathers need to be counted
# (``score_batch_packed(synchronize=True)``).

VALUE_PASS_ATTENTION = "rredcot_value_pass"
# Rows of logits computed at once when log-probs are read from hidden states: (rows, V) fp32 stays ≤ 64 MiB.
LOGIT_CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class ValuePassSettings:
    """``algorithm.rredcot.value_pass``: how the actor's value pass is split into forwards.

    Attributes:
        max_token_len: padded tokens (trace + probe tokens, summed over a micro-batch's rows) per forward, the
            value pass's ``log_prob_max_token_len_per_gpu``; a trace longer than this runs alone.
    """

    max_token_len: int = 16384

    def __post_init__(self) -> None:
        if int(self.max_token_len) < 1:
            raise ValueError(f"value_pass.max_token_len must be >= 1, got {self.max_token_len}")


def _probe_allowed(prefix_lengths: torch.Tensor, parents: torch.Tensor, cache_length: int) -> torch.Tensor:
    """(T, cache_length + T) bool: what each probe-tree token may attend to (see ``build_probe_mask``)."""
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
    return torch.cat([sees_cache, sees_probe], dim=1)


def build_probe_mask(
    prefix_lengths: torch.Tensor, parents: torch.Tensor, cache_length: int, dtype: torch.dtype
) -> torch.Tensor:
    """Additive attention mask for the probe-tree tokens run after a trace of ``cache_length`` positions.

    Probe tokens form a forest (probes at the same boundary share their common leading tokens, e.g. the exit
    text). Token i sees the trace positions < prefix_lengths[i] and its ancestors in the forest and itself.

    Args:
        prefix_lengths: (T,) long, P + b of the probe tree token i belongs to.
        parents: (T,) long, index of token i's parent token, -1 for a tree root; a parent precedes its child.
        cache_length: number of trace positions before the probe tokens.
        dtype: the model's activation dtype.

    Returns:
        (1, 1, T, cache_length + T): 0 where attention is allowed, the dtype's minimum elsewhere.
    """
    allowed = _probe_allowed(prefix_lengths, parents, cache_length)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[None, None]


# The keyword under which a value-pass forward hands its probe blocks to ``_value_pass_attention``: transformers passes
# the model call's extra keyword arguments down to the attention function.
PROBE_BLOCKS_ARGUMENT = "probe_blocks"


def _value_pass_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """Attention of a value-pass forward, whatever backend the model was configured with.

    Args:
        query: (B, H, T + Tp, D); key, value: (B, H_kv, T + Tp, D).
        attention_mask: None (no probe tokens: Tp = 0) or (B, 1, Tp, T + Tp) bool, True where a probe token may
            attend (``_probe_allowed``).
        kwargs[PROBE_BLOCKS_ARGUMENT]: with a mask, per row its probe blocks (``_probe_blocks``), or None: the probe
            tokens attend densely. Required with a mask, so that a forward which drops it fails instead of
            silently attending densely.

    Returns:
        ((B, T + Tp, H, D), None), as transformers' attention functions.
    """
    if attention_mask is None:
        return sdpa_attention_forward(module, query, key, value, None, scaling=scaling, is_causal=True)
    if PROBE_BLOCKS_ARGUMENT not in kwargs:
        raise RuntimeError(
            f"the value pass's attention got a probe mask without {PROBE_BLOCKS_ARGUMENT!r}: the model's forward did "
            "not pass the value pass's keyword arguments down to its attention"
        )
    blocks = kwargs[PROBE_BLOCKS_ARGUMENT]
    trace_len = query.shape[2] - attention_mask.shape[-2]
    # The trace part is plain causal attention (sdpa's fastest kernels); only the few probe queries need the mask.
    trace_out, _ = sdpa_attention_forward(
        module, query[:, :, :trace_len], key[:, :, :trace_len], value[:, :, :trace_len], None,
        scaling=scaling, is_causal=True,
    )
    if blocks is None:
        probe_out, _ = sdpa_attention_forward(
            module, query[:, :, trace_len:], key, value, attention_mask, scaling=scaling, is_causal=False
        )
    else:
        probe_out = _blocked_probe_attention(module, query, key, value, attention_mask, scaling, blocks, trace_len)
    return torch.cat([trace_out, probe_out], dim=1), None


BLOCKED_ATTENTION_SHARE = 0.25
"""The probe tokens attend block by block (``_blocked_probe_attention``) when the blocks' query-key pairs are at most
this share of the dense mask's: reference continuations (long chains at every boundary, a few blocks) cut it to
about a fifth on the long setting, while exit probes (a few tokens at each of 40 boundaries) stay dense, where the
many small calls would cost more than the masked pairs."""


def _probe_blocks(
    rows: Sequence[_Row], trace_len: int, tree_len: int, share: float = BLOCKED_ATTENTION_SHARE
) -> list[list[tuple[int, int, int]]] | None:
    """Per row, its probe tree cut into blocks (tree start, tree stop, trace keys): maximal runs of consecutive tree
    tokens with one prefix length (one boundary's probes), each token's ancestors inside its own run, so that a
    block's tokens see only the first ``trace keys`` trace positions and the block itself. None where a row's tree
    does not cut so, or where the blocks' query-key pairs exceed ``share`` of the dense mask's."""
    blocks, pairs = [], 0
    for row in rows:
        cuts, start = [], 0
        prefix, parents = row.tree_prefix_lengths, row.tree_parents
        for i in range(1, len(prefix) + 1):
            if i == len(prefix) or prefix[i] != prefix[start]:
                cuts.append((start, i, prefix[start]))
                start = i
            elif parents[i] >= 0 and parents[i] < start:
                return None
        blocks.append(cuts)
        pairs += sum((stop - begin) * (keys + stop - begin) for begin, stop, keys in cuts)
    if pairs > share * len(rows) * tree_len * (trace_len + tree_len):
        return None
    return blocks


def _blocked_probe_attention(module, query, key, value, allowed, scaling, blocks, trace_len):
    """The probe tokens' attention of ``_value_pass_attention``, one block at a time: a block's queries against the
    trace keys its prefix reaches and its own tokens, under the same mask restricted to them. The keys left out are
    masked for every query of the block, so each softmax runs over the same allowed keys as the dense mask's.
    Tokens outside every block (a shorter row's padding) are left at zero: nothing reads them."""
    batch, heads, _, head_dim = query.shape
    out = query.new_zeros(batch, query.shape[2] - trace_len, heads, head_dim)
    for r, row_blocks in enumerate(blocks):
        for start, stop, keys in row_blocks:
            tree = slice(trace_len + start, trace_len + stop)
            pick = lambda states: torch.cat([states[r : r + 1, :, :keys], states[r : r + 1, :, tree]], dim=2)  # noqa: E731
            mask = torch.cat([allowed[r : r + 1, :, start:stop, :keys], allowed[r : r + 1, :, start:stop, tree]], dim=-1)
            block_out, _ = sdpa_attention_forward(
                module, query[r : r + 1, :, tree], pick(key), pick(value), mask, scaling=scaling, is_causal=False
            )
            out[r, start:stop] = block_out[0]
    return out


AttentionInterface.register(VALUE_PASS_ATTENTION, _value_pass_attention)


@contextmanager
def value_pass_attention(model):
    """Run ``model``'s attention through ``_value_pass_attention`` inside the block, then restore its backend.

    verl may load the actor with ``flash_attention_2``, which would read the probe mask as a padding mask; every
    value-pass forward therefore uses this function, which calls torch's sdpa itself.
    """
    configs = {id(m.config): m.config for m in model.modules() if isinstance(m, PreTrainedModel)}
    saved = {key: config._attn_implementation_internal for key, config in configs.items()}
    model.set_attn_implementation(VALUE_PASS_ATTENTION)
    try:
        if model.config._attn_implementation != VALUE_PASS_ATTENTION:
            raise ValueError(
                f"{type(model).__name__} does not dispatch attention through transformers' AttentionInterface, "
                "so the value pass cannot give it the probe mask"
            )
        yield model
    finally:
        # Written back as found: re-validating e.g. flash_attention_2 would need its package even where the
        # model was never going to run it.
        for key, config in configs.items():
            config._attn_implementation_internal = saved[key]


def _chunked_head(
    head,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    *,
    entropy: bool,
    transform: LogitTransform = LogitTransform(),
    temperature: float = 1.0,
):
    """Log-probs (and entropies) of ``targets`` under softmax(transform(W h + b) / temperature), in fp32, a bounded
    block of logits at a time.

    The projection itself runs in fp32 (hidden states and a vocabulary slice of the weight upcast): a bf16 matmul
    rounds its output to bf16, which at |logit| 16-32 resolves only 0.125, i.e. about ±0.06 nats of noise on every
    scored token. Only the read rows are projected, so the upcast costs one (rows, vocabulary slice) fp32 block at a
    time; the log-normaliser (and entropy) accumulate over vocabulary slices with a running maximum.

    Args:
        head: the output projection (``model.get_output_embeddings()``), read where its weight is gathered.
        hidden: (N, d) final hidden states; targets: (N,) token ids.
        transform: what the model's forward does to the projection (``core.model_support.logit_transform``).
        temperature: the sampling temperature the logits are divided by, after the transform (as verl does).

    Returns:
        (N,) fp32 log-probs, and (N,) fp32 entropies or None.
    """
    weight, bias = head.weight, head.bias
    vocab, width = weight.shape
    vocab_step = min(vocab, max(1, LOGIT_CHUNK_ELEMENTS // width))  # an fp32 weight slice of ≤ 64 MiB
    rows = max(1, LOGIT_CHUNK_ELEMENTS // vocab_step)  # an fp32 logit block of ≤ 64 MiB
    n = hidden.shape[0]
    target_logit = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    running_max = torch.full((n,), float("-inf"), dtype=torch.float32, device=hidden.device)
    exp_sum = torch.zeros_like(target_logit)
    weighted = torch.zeros_like(target_logit)  # Σ exp(l − max) · l, for the entropy
    for lo in range(0, vocab, vocab_step):
        hi = min(lo + vocab_step, vocab)
        weight_slice = weight[lo:hi].float()
        bias_slice = None if bias is None else bias[lo:hi].float()
        for start in range(0, n, rows):
            block = slice(start, min(start + rows, n))
            logits = transform(torch.nn.functional.linear(hidden[block].float(), weight_slice, bias_slice))
            if temperature != 1.0:
                logits = logits / temperature
            inside = (targets[block] >= lo) & (targets[block] < hi)
            local = (targets[block] - lo).clamp(0, hi - lo - 1)
            target_logit[block] = torch.where(inside, logits.gather(-1, local[:, None])[:, 0], target_logit[block])
            new_max = torch.maximum(running_max[block], logits.amax(-1))
            rescale = torch.exp(running_max[block] - new_max)
            shifted = torch.exp(logits - new_max[:, None])
            exp_sum[block] = exp_sum[block] * rescale + shifted.sum(-1)
            if entropy:
                weighted[block] = weighted[block] * rescale + (shifted * logits).sum(-1)
            running_max[block] = new_max
    log_norm = running_max + exp_sum.log()
    return target_logit - log_norm, (log_norm - weighted / exp_sum) if entropy else None


def execution_device(model) -> torch.device:
    """Where the model computes: the device of its buffers (rotary frequencies), else of its input embedding.

    Under FSDP2 with ``offload_policy=True`` the sharded parameters stay on the CPU while FSDP moves the inputs and
    buffers to the GPU, so a parameter's device is not where activations live.
    """
    for buffer in model.buffers():
        if buffer.device.type != "meta":
            return buffer.device
    return model.get_input_embeddings().weight.device


@dataclass
class _Row:
    """One trace of a micro-batch: its tokens, its probe tree and what is read from its hidden states.

    ``tree_*`` hold the probe-tree tokens (see ``_probe_tree``); ``reads`` are (position, target, kept probe) of the
    first scored tokens predicted by the trace itself; ``nodes`` are (tree node, target, kept probe).
    """

    tokens: torch.Tensor
    prompt_len: int
    response_len: int
    kept: list[int]
    tree_ids: list[int]
    tree_positions: list[int]
    tree_prefix_lengths: list[int]
    tree_parents: list[int]
    reads: list[tuple[int, int, int]]
    nodes: list[tuple[int, int, int]]
    trace_stats: bool

    @property
    def needs_forward(self) -> bool:
        return bool(self.kept) or (self.trace_stats and self.response_len > 0)


def _build_row(prompt_ids, response_ids, probes: Sequence[Probe], max_positions, trace_stats: bool) -> _Row:
    """Merge the probes that fit into a token forest (probes at the same boundary share their common leading
    tokens, so K·|C| exit probes cost K·(|exit| + |C|·(|answer| - 1)) tokens instead of K·|C|·(a - 1)).

    A probe's text ``forced + scored`` (length n) enters as its first n-1 tokens at positions P+b .. P+b+n-2 (the
    last token is only predicted). Its first token is predicted by the trace at position P+b-1, so a probe with
    empty ``forced_ids`` reads its first scored log-prob there.
    """
    prompt_len = prompt_ids.numel()
    tokens = torch.cat([prompt_ids.long(), response_ids.long()])
    kept = [i for i, probe in enumerate(probes) if probe_fits(probe, prompt_len, max_positions)]
    node_of = {}  # (boundary, parent node, token) → node index
    row = _Row(tokens, prompt_len, response_ids.numel(), kept, [], [], [], [], [], [], trace_stats)
    for j, index in enumerate(kept):
        probe = probes[index]
        text, start = probe.tokens, prompt_len + probe.boundary
        if not probe.forced_ids:
            row.reads.append((start - 1, text[0], j))
        parent = -1
        for i, token in enumerate(text[:-1]):
            key = (probe.boundary, parent, token)
            if key not in node_of:
                node_of[key] = len(row.tree_ids)
                row.tree_ids.append(token)
                row.tree_positions.append(start + i)
                row.tree_prefix_lengths.append(start)
                row.tree_parents.append(parent)
            parent = node_of[key]
            # Node i predicts text[i + 1]; it counts when that token is scored (index ≥ len(forced)).
            if i + 1 >= len(probe.forced_ids):
                row.nodes.append((parent, text[i + 1], j))
    return row


MIN_MICRO_BATCH_FILL = 0.85
"""A row joins a micro-batch only while at least this fraction of the batch's padded tokens are real: rows pad to
the longest trace plus the largest probe tree, and mixing widths wasted 35% of the tokens on the tiny recipe's
batches. Measured there (32 traces, one thread): one micro-batch 0.98 s, fill 0.75 0.75 s, 0.85 0.65 s (4
forwards), 0.95 0.59 s (7 forwards); higher fills buy little and add forwards, each of which all-gathers the
parameters under FSDP."""


def plan_micro_batches(shapes: Sequence[tuple[int, int]], max_token_len: int) -> list[list[int]]:
    """Group rows into micro-batches of at most ``max_token_len`` padded tokens, at least ``MIN_MICRO_BATCH_FILL``
    of them real.

    A micro-batch pads every row to its longest trace plus its largest probe tree (``_forward_micro_batch``), so
    its padded size is rows × (max trace tokens + max tree tokens). Rows are taken widest first, so that rows of
    similar width share a micro-batch; a row wider than the budget runs alone.

    Args:
        shapes: (n,) (trace tokens, probe-tree tokens) of each row.

    Returns:
        Lists of row indices, one per micro-batch.
    """
    batches: list[list[int]] = []
    padded = lambda rows: len(rows) * (max(shapes[i][0] for i in rows) + max(shapes[i][1] for i in rows))  # noqa: E731
    for index in sorted(range(len(shapes)), key=lambda i: (-sum(shapes[i]), -shapes[i][0])):
        if batches:
            candidate = [*batches[-1], index]
            size = padded(candidate)
            if size <= max_token_len and sum(sum(shapes[i]) for i in candidate) >= MIN_MICRO_BATCH_FILL * size:
                batches[-1] = candidate
                continue
        batches.append([index])
    return batches


def _forward_micro_batch(
    model,
    rows: Sequence[_Row],
    temperature: float = 1.0,
    transform: LogitTransform = LogitTransform(),
    blocked_attention_share: float = BLOCKED_ATTENTION_SHARE,
) -> list[dict]:
    """One forward over ``rows`` (trace then probe tokens per row); returns per row the log-probs it reads, under
    the sampling distribution softmax(logits / temperature), the logits being ``transform`` of the head's output.
    The probe tokens attend block by block where ``_probe_blocks`` allows it under ``blocked_attention_share``.

    Returns:
        Per row: ``reads`` (len(row.reads),), ``nodes`` (len(row.nodes),) and, with trace stats, ``log_probs``
        and ``entropy`` (L,), all fp32 on CPU.
    """
    device = execution_device(model)
    trace_len = max(row.tokens.numel() for row in rows)
    tree_len = max(len(row.tree_ids) for row in rows)
    input_ids = torch.zeros(len(rows), trace_len + tree_len, dtype=torch.long)
    position_ids = torch.zeros_like(input_ids)
    position_ids[:, :trace_len] = torch.arange(trace_len)
    allowed = torch.zeros(len(rows), 1, tree_len, trace_len + tree_len, dtype=torch.bool)
    for r, row in enumerate(rows):
        input_ids[r, : row.tokens.numel()] = row.tokens
        n = len(row.tree_ids)
        input_ids[r, trace_len : trace_len + n] = torch.tensor(row.tree_ids, dtype=torch.long)
        position_ids[r, trace_len : trace_len + n] = torch.tensor(row.tree_positions, dtype=torch.long)
        # Padding tokens of the tree: prefix 0 and no parent, so they see only themselves (no empty softmax row).
        prefix = torch.tensor(row.tree_prefix_lengths + [0] * (tree_len - n), dtype=torch.long)
        parents = torch.tensor(row.tree_parents + [-1] * (tree_len - n), dtype=torch.long)
        allowed[r, 0] = _probe_allowed(prefix, parents, trace_len)

    # Where each row reads: (row, position, target) triples of the point reads, then the trace-stat spans.
    point_rows, point_positions, point_targets = [], [], []
    span_rows, span_positions, span_targets = [], [], []
    for r, row in enumerate(rows):
        for position, target, _ in row.reads:
            point_rows.append(r), point_positions.append(position), point_targets.append(target)
        for node, target, _ in row.nodes:
            point_rows.append(r), point_positions.append(trace_len + node), point_targets.append(target)
        if row.trace_stats:
            span_rows += [r] * row.response_len
            span_positions += range(row.prompt_len - 1, row.prompt_len - 1 + row.response_len)
            span_targets += row.tokens[row.prompt_len :].tolist()

    head = model.get_output_embeddings()
    results = {}

    def read(hidden: torch.Tensor) -> torch.Tensor:
        # The final hidden states (B, T + Tp, d) give exactly the log-probs that are read; the head then projects
        # one position per row.
        as_index = lambda values: torch.tensor(values, dtype=torch.long, device=hidden.device)  # noqa: E731
        logits_as = {"transform": transform, "temperature": temperature}
        results["points"], _ = _chunked_head(
            head, hidden[as_index(point_rows), as_index(point_positions)], as_index(point_targets), entropy=False,
            **logits_as,
        )
        results["span"] = _chunked_head(
            head, hidden[as_index(span_rows), as_index(span_positions)], as_index(span_targets), entropy=True,
            **logits_as,
        )
        return hidden[:, -1:]

    def on_head_input(module, args):
        # Inside the head's own forward: under FSDP2 its weight is gathered there, whichever unit holds it.
        return (read(args[0]),)

    def on_decoder_output(module, args, output):
        # verl's fused-kernel forward never calls the head (it reads lm_head.weight itself): read on the decoder's
        # output instead, inside the model's forward, where verl reads the weight too.
        output.last_hidden_state = read(output[0])
        return output

    blocks = _probe_blocks(rows, trace_len, tree_len, blocked_attention_share) if tree_len else None
    probe_blocks = {PROBE_BLOCKS_ARGUMENT: blocks}

    def pass_probe_blocks(module, args, kwargs):
        # verl's fused-kernel forward calls the decoder with its named arguments only: hand the blocks to that call.
        return args, {**kwargs, **probe_blocks}

    forward_kwargs = _one_position_kwargs(model, len(rows), device)
    if _fused_kernel_forward(model):
        decoder = model.get_decoder()
        handles = [decoder.register_forward_pre_hook(pass_probe_blocks, with_kwargs=True),
                   decoder.register_forward_hook(on_decoder_output)]
    else:
        handles = [head.register_forward_pre_hook(on_head_input)]
        forward_kwargs.update(probe_blocks)
    try:
        model(
            input_ids=input_ids.to(device),
            position_ids=position_ids.to(device),
            attention_mask=allowed.to(device) if tree_len else None,
            **forward_kwargs,
        )
    finally:
        for handle in handles:
            handle.remove()

    points, (span_log_probs, span_entropy) = results["points"].cpu(), results["span"]
    span_log_probs, span_entropy = span_log_probs.cpu(), span_entropy.cpu()
    outputs, point, span = [], 0, 0
    for row in rows:
        out = {"reads": points[point : point + len(row.reads)]}
        point += len(row.reads)
        out["nodes"] = points[point : point + len(row.nodes)]
        point += len(row.nodes)
        if row.trace_stats:
            out["log_probs"] = span_log_probs[span : span + row.response_len]
            out["entropy"] = span_entropy[span : span + row.response_len]
            span += row.response_len
        outputs.append(out)
    return outputs


def _fused_kernel_forward(model) -> bool:
    """verl's ``use_fused_kernels`` replaced the model class's ``forward`` (it marks the instance)."""
    return getattr(model, "_verl_fused_kernels_backend", None) is not None


def _one_position_kwargs(model, batch_size: int, device) -> dict:
    """Forward arguments under which the model's head projects one position per row.

    verl's fused-kernel forward needs ``return_dict`` and takes its targets from ``labels``: labels of width 1 match
    the one hidden position the decoder hook leaves. transformers' own forward keeps every position of that one
    (``logits_to_keep=0``).
    """
    if _fused_kernel_forward(model):
        return {"use_cache": False, "return_dict": True, "labels": torch.zeros(batch_size, 1, dtype=torch.long, device=device)}
    return {"use_cache": False, "logits_to_keep": 0}


def _dummy_forward(model) -> None:
    """A one-token forward: its only purpose is to join the parameter all-gathers of the other ranks."""
    device = execution_device(model)
    model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), **_one_position_kwargs(model, 1, device))


def _forwards_on_every_rank(model, local: int) -> int:
    """The largest number of forwards any data-parallel rank makes (``local`` without torch.distributed)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return local
    count = torch.tensor([local], dtype=torch.long, device=execution_device(model))
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
    return int(count.item())


@dataclass
class BatchStats:
    """Forwards of one ``score_batch_packed`` call: ``micro_batches`` with data, ``dummy_forwards`` to match the
    other ranks' count."""

    micro_batches: int
    dummy_forwards: int


@torch.no_grad()
def score_batch_packed_with_stats(
    model,
    prompt_ids: Sequence[torch.Tensor],
    response_ids: Sequence[torch.Tensor],
    probes: Sequence[Sequence[Probe]],
    *,
    return_trace_stats: bool | Sequence[bool] = True,
    max_positions: int | None = None,
    max_token_len: int = ValuePassSettings.max_token_len,
    synchronize: bool = False,
    temperature: float = 1.0,
    blocked_attention_share: float = BLOCKED_ATTENTION_SHARE,
) -> tuple[list[PackedScores], BatchStats]:
    """Score the probes of a batch of traces, one forward per micro-batch of at most ``max_token_len`` tokens.

    Log-probs are computed only where they are read (probe tokens, and the response when trace stats are asked
    for), from the final hidden states a bounded number of rows at a time: no (T, V) logits tensor.

    Args:
        model: a transformers causal LM that ``core.model_support.value_pass_refusal`` accepts (full causal
            attention dispatched through transformers' AttentionInterface, whatever backend is configured: the value
            pass uses its own, see ``value_pass_attention``; the model's own logit scaling or softcapping is applied).
        prompt_ids: n tensors (P_i,), P_i ≥ 1.
        response_ids: n tensors (L_i,), L_i ≥ 0.
        probes: n probe lists, 0 ≤ boundary ≤ L_i.
        return_trace_stats: per trace (or one bool for all): also return the response's log-probs and entropies.
        max_positions: position budget; probes with P + b + len(forced) + len(scored) > max_positions are skipped.
        max_token_len: padded tokens per forward (``plan_micro_batches``).
        synchronize: under torch.distributed, make as many forwards as the rank with the most micro-batches
            (one-token dummy forwards), so that FSDP's per-forward all-gathers pair up across ranks whatever the
            data. Uses the default process group: the ranks that shard the model.
        temperature: log-probs under softmax(logits / temperature), the rollout's sampling distribution.
        blocked_attention_share: a micro-batch's probe tokens attend block by block where the blocks' query-key
            pairs are at most this share of the dense mask's (``BLOCKED_ATTENTION_SHARE``): 0 never, 1 wherever the
            probe trees cut into blocks. The log-probs are the same either way; only the time differs.

    Returns:
        n PackedScores: probe_logp (n_probes_i,), trace_log_probs / trace_entropy (L_i,) or None, num_skipped;
        and ``BatchStats``, the forwards made.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    refusal = value_pass_refusal(model.config, model)
    if refusal is not None:
        # The launch refuses the same models from their config (integration/run_shapes.py); this is the last guard.
        raise ValueError(f"the value pass cannot score this model exactly: {refusal}")
    transform = logit_transform(model.config)
    if not len(prompt_ids) == len(response_ids) == len(probes):
        raise ValueError(
            f"batch sizes differ: {len(prompt_ids)} prompts, {len(response_ids)} responses, {len(probes)} probe lists"
        )
    if isinstance(return_trace_stats, bool):
        return_trace_stats = [return_trace_stats] * len(prompt_ids)
    if len(return_trace_stats) != len(prompt_ids):
        raise ValueError(f"return_trace_stats has {len(return_trace_stats)} entries for {len(prompt_ids)} traces")
    if max_token_len < 1:
        raise ValueError(f"max_token_len must be >= 1, got {max_token_len}")
    if not 0 <= blocked_attention_share <= 1:
        raise ValueError(f"blocked_attention_share must be in [0, 1], got {blocked_attention_share}")
    rows = []
    for prompt, response, trace_probes, stats in zip(prompt_ids, response_ids, probes, return_trace_stats):
        check_inputs(prompt, response, trace_probes)
        rows.append(_build_row(prompt, response, trace_probes, max_positions, bool(stats)))

    active = [i for i, row in enumerate(rows) if row.needs_forward]
    shapes = [(rows[i].tokens.numel(), len(rows[i].tree_ids)) for i in active]
    batches = [[active[i] for i in batch] for batch in plan_micro_batches(shapes, max_token_len)]
    total = _forwards_on_every_rank(model, len(batches)) if synchronize else len(batches)
    outputs: dict[int, dict] = {}
    with value_pass_attention(model):
        for batch in batches:
            micro_batch = [rows[i] for i in batch]
            outputs.update(zip(batch, _forward_micro_batch(model, micro_batch, temperature, transform,
                                                           blocked_attention_share)))
        for _ in range(total - len(batches)):
            _dummy_forward(model)

    results = []
    for i, (trace_probes, row) in enumerate(zip(probes, rows)):
        out = outputs.get(i, {})
        kept_logp = torch.zeros(len(row.kept), dtype=torch.float32)
        for values, entries in ((out.get("reads"), row.reads), (out.get("nodes"), row.nodes)):
            if entries:
                kept_logp.index_add_(0, torch.tensor([owner for _, _, owner in entries]), values)
        probe_logp = torch.full((len(trace_probes),), float("nan"), dtype=torch.float32)
        probe_logp[row.kept] = kept_logp
        log_probs = entropy = None
        if row.trace_stats:
            empty = torch.zeros(0, dtype=torch.float32)
            log_probs, entropy = out.get("log_probs", empty), out.get("entropy", empty)
        results.append(PackedScores(probe_logp, log_probs, entropy, num_skipped=len(trace_probes) - len(row.kept)))
    return results, BatchStats(len(batches), total - len(batches))


def score_batch_packed(model, prompt_ids, response_ids, probes, **options) -> list[PackedScores]:
    """``score_batch_packed_with_stats`` without its forward counts (same arguments)."""
    return score_batch_packed_with_stats(model, prompt_ids, response_ids, probes, **options)[0]


def score_probes_packed(
    model,
    prompt_ids: torch.Tensor,
    response_ids: torch.Tensor,
    probes: Sequence[Probe],
    *,
    return_trace_stats: bool = True,
    max_positions: int | None = None,
) -> PackedScores:
    """``score_batch_packed`` for one trace: one forward over prompt + response + the probe-tree tokens.

    Args:
        prompt_ids: (P,) token ids, P ≥ 1; response_ids: (L,) token ids, L ≥ 0.
        probes: n_probes probes with 0 ≤ boundary ≤ L.

    Returns:
        PackedScores with probe_logp (n_probes,), trace_log_probs (L,), trace_entropy (L,), num_skipped.
    """
    return score_batch_packed(
        model, [prompt_ids], [response_ids], [probes], return_trace_stats=return_trace_stats,
        max_positions=max_positions, max_token_len=prompt_ids.numel() + response_ids.numel() + 1,
    )[0]
