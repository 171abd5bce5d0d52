"""Mixture of experts (DeepSeek-V3 style): top-k router with group-limited routing and an aux-loss-free
expert bias, routed experts as stacked weights, optional shared experts, optional load-balancing loss.

Dispatch: the router's choices go to the host, the (token, choice) pairs are sorted by expert, and the
rows grouped by expert go to the layer's own experts, which run as one batched matmul over a buffer padded to
the busiest expert's count — or, under expert parallelism, to the all-to-all dispatcher of
``training.parallel.expert_parallel``. The weighted outputs are scatter-added back per token
(``unsorted_segment_sum``, whose gradient is a gather). Layouts (MindFormers' grouped GEMM):
``experts.weight1`` [E, hidden, 2·ffn] with the gate in the first half of the last axis and up in the
second, ``experts.weight2`` [E, ffn, hidden] (input-major: the transpose of an HF Linear weight).
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from training.model.layers import Init, _matmul_transpose_b, cast
from training.model.spec import ModuleSpec, build_module

LOAD_BALANCING_TYPES = ("none", "aux_loss", "seq_aux_loss")


class TopKRouter(nn.Cell):
    """Scores every expert for every token (fp32); picks top-k by score + expert bias within the best
    ``topk_group`` of ``n_group`` groups (a group's score: the sum of its top-2); gates come from the
    unbiased scores, renormalised if ``norm_topk_prob``, times ``routed_scaling_factor``."""

    def __init__(self, init: Init, config):
        super().__init__()
        self.weight = init.normal(config.n_routed_experts, config.hidden_size)
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.score_function = config.moe_router_score_function
        self.norm_topk_prob = config.norm_topk_prob
        self.scaling = config.routed_scaling_factor

    def construct(self, tokens: Tensor, expert_bias: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """tokens [T, hidden] → (scores [T, E] fp32, chosen experts [T, k], gates [T, k])."""
        logits = _matmul_transpose_b(cast(tokens, ms.float32), cast(self.weight, ms.float32))
        scores = ops.sigmoid(logits) if self.score_function == "sigmoid" else ops.softmax(logits, axis=-1)
        selection = ops.stop_gradient(scores) + expert_bias
        if self.n_group > 1:
            grouped = selection.reshape(-1, self.n_group, self.num_experts // self.n_group)
            group_scores = ops.topk(grouped, 2)[0].sum(-1)                          # [T, n_group]
            _, kept = ops.topk(group_scores, self.topk_group)
            keep = ops.one_hot(kept, self.n_group, Tensor(1.0, ms.float32), Tensor(0.0, ms.float32)).sum(1)
            keep = ops.broadcast_to(keep.expand_dims(-1), grouped.shape).reshape(selection.shape)
            selection = ops.where(keep > 0, selection, Tensor(float(np.finfo(np.float32).min), ms.float32))
        _, chosen = ops.topk(selection, self.top_k)
        gates = ops.gather_elements(scores, 1, chosen)
        if self.norm_topk_prob:
            gates = gates / (gates.sum(-1, keepdims=True) + 1e-20)
        return scores, chosen, gates * self.scaling


class GroupedExperts(nn.Cell):
    """E SwiGLU experts as two stacked weights (see the module docstring for the layout)."""

    def __init__(self, init: Init, config):
        super().__init__()
        experts, hidden, ffn = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.ffn = ffn
        self.weight1 = init.normal(experts, hidden, 2 * ffn)
        self.weight2 = init.normal(experts, ffn, hidden)

    def construct(self, x_sorted: Tensor, counts: np.ndarray) -> Tensor:
        """x_sorted: [assignments, hidden], grouped by expert in expert order with ``counts[e]`` rows each.

        All experts run as one batched matmul over [E, capacity, hidden], capacity = the busiest expert's
        count, padding rows zero: in PyNative every op costs ~1 ms of dispatch, and a per-expert loop
        (split, unstack, 5 ops per expert, cat) took 3.8x longer forward+backward than the padded
        compute at E=8."""
        assignments, hidden = x_sorted.shape
        experts = len(counts)
        capacity = max(int(counts.max()), 1)
        starts = np.cumsum(counts) - counts
        rank = np.arange(assignments) - np.repeat(starts, counts)        # position within its expert
        slot = (np.repeat(np.arange(experts), counts) * capacity + rank).astype(np.int32)
        rows = np.full(experts * capacity, assignments, np.int32)        # padding reads the zero row
        rows[slot] = np.arange(assignments, dtype=np.int32)
        padded = ops.gather(ops.cat([x_sorted, ops.zeros((1, hidden), x_sorted.dtype)], 0), Tensor(rows), 0)
        gate, up = ops.chunk(ops.bmm(padded.reshape(experts, capacity, hidden),
                                     cast(self.weight1, x_sorted.dtype)), 2, axis=-1)
        out = ops.bmm(ops.silu(gate) * up, cast(self.weight2, x_sorted.dtype))
        return ops.gather(out.reshape(experts * capacity, hidden), Tensor(slot), 0)


class MoELayer(nn.Cell):
    """Routed experts (+ shared experts) in place of the dense MLP; the router, the routed experts and
    the shared experts (None: none) come from the spec. Keeps, per step, how many tokens each expert
    received (``tokens_per_expert``), and the load-balancing loss of the last forward (``aux_loss``,
    None when moe_aux_loss_coeff is 0 or the type is 'none')."""

    def __init__(self, init: Init, config, router: ModuleSpec, experts: ModuleSpec,
                 shared_experts: ModuleSpec | None = None):
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.router = build_module(router, init, config)
        self.experts = build_module(experts, init, config)
        self.shared_experts = build_module(shared_experts, init, config) if shared_experts else None
        self.expert_bias = Parameter(Tensor(np.zeros(self.num_experts, np.float32)), requires_grad=False)
        self.tokens_per_expert = Parameter(Tensor(np.zeros(self.num_experts, np.float32)), requires_grad=False)
        self.enable_expert_bias = config.moe_router_enable_expert_bias
        self.bias_update_rate = config.moe_router_bias_update_rate
        self.balancing = config.moe_router_load_balancing_type
        self.aux_coeff = config.moe_aux_loss_coeff
        self.aux_loss: Tensor | None = None
        self._counts = np.zeros(self.num_experts, np.int64)
        # sequence parallel: sums the loss statistics over the ranks holding the other parts of the sequences
        # (forward all-reduce, backward identity); None when this rank sees whole sequences
        self.sequence_shard_sum = None
        # context parallelism: 1/cp. Each cp rank's loss is its part of its samples' loss, and every cp rank
        # computes the whole balancing loss (from statistics summed over cp), so each adds its share
        self.aux_loss_share = 1.0
        # expert parallelism: (rows grouped by expert, counts over all experts) -> the experts' outputs in the same
        # order, through its all-to-all dispatch; None: this layer's own experts take the rows
        self.token_dispatcher = None

    def construct(self, x: Tensor) -> Tensor:
        batch, seq, hidden = x.shape
        tokens = x.reshape(-1, hidden)
        scores, chosen, gates = self.router(tokens, self.expert_bias)
        choices = chosen.asnumpy().reshape(-1)                     # [T·k], token t's j-th choice at t·k + j
        order = np.argsort(choices, kind="stable")
        counts = np.bincount(choices, minlength=self.num_experts)
        token_of = Tensor((order // self.top_k).astype(np.int32))
        x_sorted = ops.gather(tokens, token_of, 0)
        gate_sorted = cast(ops.gather(gates.reshape(-1), Tensor(order.astype(np.int32)), 0), x.dtype)
        run_experts = self.token_dispatcher or self.experts
        routed = run_experts(x_sorted, counts) * gate_sorted.expand_dims(-1)
        out = ops.unsorted_segment_sum(routed, token_of, tokens.shape[0]).reshape(x.shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        self._counts += counts
        self.aux_loss = self._load_balancing_loss(scores, choices.reshape(batch, seq * self.top_k))
        return out

    def _load_balancing_loss(self, scores: Tensor, choices: np.ndarray) -> Tensor | None:
        """coeff · Σ_i f_i·P_i: f_i = E/(k·T)·(tokens choosing expert i), P_i = mean routing probability of
        expert i (scores normalised per token), over each sequence ('seq_aux_loss', then averaged) or over
        the whole micro-batch ('aux_loss'). Under sequence parallelism the counts and probability sums are
        summed over the sequence's shards first (one collective), as MindFormers' router does."""
        if self.balancing == "none" or self.aux_coeff == 0:
            return None
        batch = choices.shape[0]
        probs = scores / scores.sum(-1, keepdims=True)
        if self.balancing == "aux_loss":
            choices, probs = choices.reshape(1, -1), probs.reshape(1, -1, self.num_experts)
        else:
            probs = probs.reshape(batch, -1, self.num_experts)
        rows = choices.shape[0]
        counts = Tensor(np.stack([np.bincount(row, minlength=self.num_experts) for row in choices]).astype(np.float32))
        prob_sums = probs.sum(1)
        if self.sequence_shard_sum is not None:
            counts, prob_sums = ops.split(self.sequence_shard_sum(ops.cat((counts, prob_sums))), rows)
        choices_per_row = counts.sum(-1, keepdims=True)  # k·tokens per row
        fraction = counts * self.num_experts / choices_per_row
        mean_probs = prob_sums / (choices_per_row / self.top_k)
        return (fraction * mean_probs).sum(-1).mean() * self.aux_coeff * self.aux_loss_share

    # ---- between steps ----
    def take_counts(self) -> np.ndarray:
        """Tokens per expert since the last call (all micro-batches of the step); resets them."""
        counts, self._counts = self._counts, np.zeros(self.num_experts, np.int64)
        return counts

    def update_expert_bias(self, counts: np.ndarray) -> None:
        """Aux-loss-free balancing: bias += rate · sign(mean count − count), from the step's counts summed
        over data-parallel ranks; ``tokens_per_expert`` keeps those counts for the checkpoint."""
        self.tokens_per_expert.set_data(Tensor(counts.astype(np.float32)))
        if self.enable_expert_bias:
            step = self.bias_update_rate * np.sign(counts.mean() - counts)
            self.expert_bias.set_data(Tensor((self.expert_bias.asnumpy() + step).astype(np.float32)))

    def expert_parameters(self) -> int:
        return int(np.prod(self.experts.weight1.shape) + np.prod(self.experts.weight2.shape))
