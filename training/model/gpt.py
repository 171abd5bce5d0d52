"""GPTModel: the one model interface. A family config (Qwen3Config, DeepseekV3Config) supplies the layer
specs, the rotary tables and the sizes; GPTModel assembles

embedding → TransformerBlock (one layer per spec) → output layer (or the tied embedding)
          [→ MultiTokenPredictionBlock: one more token per depth, sharing embedding and output layer]

and returns the training loss: main loss + mtp_loss_scaling_factor · mean(MTP depth losses) + MoE
load-balancing losses. Parameter names follow MindFormers' pynative Megatron-style layout (no prefix,
global layer indices): ``decoder.layers.{i}.self_attention.linear_qkv.weight`` etc.
"""
from __future__ import annotations

from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from training.config import Section, require
from training.model import ascend
from training.model.dropout import Dropout, MaskStream
from training.model.layers import (DTYPE_FIELDS, DTYPES, Init, LanguageModelEmbedding, Linear, RotaryEmbedding,
                                   additive_mask, causal_mask, cast, token_cross_entropy)
from training.model.moe import MoELayer
from training.model.mtp import MultiTokenPredictionBlock
from training.model.spec import ModuleSpec, check_tensor_parallel
from training.model.transformer import TransformerBlock, TransformerLayer, run_layer


@dataclass
class GPTConfig(Section):
    """Fields every family shares, with Hugging Face names (plus MindFormers' ``seq_length`` and dtypes).
    Families override defaults and add their own fields, and implement the hooks below."""
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    seq_length: int = 4096
    # MindFormers' precision fields and defaults: matmuls run in compute_dtype, the rest where named
    compute_dtype: str = "bfloat16"
    params_dtype: str = "float32"
    layernorm_compute_dtype: str = "float32"
    softmax_compute_dtype: str = "float32"
    rotary_dtype: str = "float32"
    # dropout on the embedding output and on each attention/MLP output before its residual add, in training
    # only (MindFormers' TransformerConfig default; DeepSeek-V3 registers 0)
    hidden_dropout: float = 0.1
    # MindFormers' switch for Ascend's FlashAttentionScore: used on Ascend where the heads allow it, the plain
    # attention elsewhere (training/model/ascend.py; the trainer's `training step:` line says which and why)
    use_flash_attention: bool = False

    def check(self, path: str) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "seq_length"):
            require(getattr(self, name) > 0, f"{path}.{name} must be > 0, got {getattr(self, name)}")
        for name in ("rms_norm_eps", "rope_theta", "initializer_range"):
            require(getattr(self, name) > 0, f"{path}.{name} must be > 0, got {getattr(self, name)}")
        require(self.seq_length <= self.max_position_embeddings,
                f"{path}.seq_length ({self.seq_length}) exceeds {path}.max_position_embeddings "
                f"({self.max_position_embeddings})")
        require(self.hidden_act == "silu", f"{path}.hidden_act = {self.hidden_act!r}: only 'silu' (SwiGLU) is implemented")
        for name in DTYPE_FIELDS:
            value = getattr(self, name)
            require(value in DTYPES, f"{path}.{name} = {value!r}: expected one of {', '.join(DTYPES)}")
        require(0.0 <= self.hidden_dropout < 1.0, f"{path}.hidden_dropout must be in [0, 1), got {self.hidden_dropout}")
        if ms.get_context("device_target") == "CPU":
            for name in DTYPE_FIELDS:  # float16 kernels exist on CPU (MindSpore 2.10), bfloat16 ones do not
                value = getattr(self, name)
                default = " (MindFormers' default)" if name == "compute_dtype" else ""
                require(DTYPES[value] != ms.bfloat16,
                        f"{path}.{name} = {value!r}{default} cannot run on CPU: MindSpore 2.10's CPU MatMul, Softmax "
                        f"and reductions have no bfloat16 "
                        f"kernels; set {path}.{name}: float32 (or float16)")
        ascend.check_config(self, path)

    def dtype(self, name: str):
        """The MindSpore dtype of the precision field ``name``."""
        return DTYPES[getattr(self, name)]

    def check_tensor_parallel(self, tp) -> None:
        """What tensor parallelism ``tp`` (training.parallel.tensor_parallel.TensorParallelRequirements) needs of
        the model this config builds: the vocabulary and sequence here, each layer's modules from their specs
        (the MTP layers reuse the last decoder layer's). Nothing is built: a launch asks before msrun starts."""
        tp.require_divisible(self.vocab_size, "model.vocab_size", "each rank holds an equal slice of the vocabulary")
        if tp.sequence_parallel:
            tp.require_divisible(self.seq_length, "model.seq_length",
                                 "sequence parallelism gives each rank an equal part of every sequence")
        elif self.hidden_dropout > 0:
            tp.refuse(f"model.hidden_dropout ({self.hidden_dropout}) with tensor parallelism needs "
                      "parallelism.sequence_parallel: true: without it every tp rank holds the same activations and "
                      "would drop different elements of them")
        for spec in self.decoder_layer_specs():
            check_tensor_parallel(spec, self, tp)

    # ---- what a family supplies ----
    has_moe = False
    num_mtp_layers = 0
    mtp_loss_scale = 0.0

    def decoder_layer_specs(self) -> list[ModuleSpec]:
        raise NotImplementedError

    def rotary_embedding(self) -> RotaryEmbedding:
        raise NotImplementedError

    def mask_repeats(self) -> int:
        """How many times the attention stacks the [seq, seq] mask along its query axis."""
        raise NotImplementedError

    def attention_dims(self) -> tuple[int, int, int]:
        """(heads, q·k head dim, v head dim), for FLOP counting."""
        raise NotImplementedError


def roll_left(x: Tensor) -> Tensor:
    """[batch, seq] shifted one position left, the freed last position zero (MTP's next-token view)."""
    return ops.cat((x[:, 1:], ops.zeros_like(x[:, :1])), axis=1)


def roll_each_left(*tensors: Tensor) -> tuple[Tensor, ...]:
    return tuple(roll_left(x) for x in tensors)


class GPTModel(nn.Cell):
    """Causal LM built from ``config``'s specs. ``construct(input_ids, labels, loss_mask[, position_ids,
    attention_mask])`` returns the training loss; ``loss_and_parts`` the loss and its parts."""

    def __init__(self, config: GPTConfig, seed: int | None = None):
        super().__init__()
        self.config = config
        self.compute_dtype = DTYPES[config.compute_dtype]
        if seed is None:  # follow mindspore.set_seed (the trainer sets it); unseeded runs still init the same
            seed = ms.get_seed() or 0
        init = Init(seed, config.initializer_range)
        self.embedding = LanguageModelEmbedding(init, config.vocab_size, config.hidden_size)
        self.rotary = config.rotary_embedding()
        layer_specs = config.decoder_layer_specs()
        self.decoder = TransformerBlock(init, config, layer_specs)
        self.output_layer = None if config.tie_word_embeddings else Linear(init, config.hidden_size, config.vocab_size)
        # MTP layers reuse the last decoder layer's spec (as MindFormers' get_gpt_mtp_block_spec)
        self.mtp = MultiTokenPredictionBlock(init, config, layer_specs[-1]) if config.num_mtp_layers else None
        self.embedding.word_embeddings.is_output_layer = self.output_layer is None
        self.mask_repeats = config.mask_repeats()
        # the parts of the loss besides itself, for the log: none for a plain dense model (its loss is the LM loss)
        self._mtp_loss_names = [f"mtp_{k + 1}_loss" for k in range(config.num_mtp_layers)]
        self._aux_loss_stats = [moe.stats for _, moe in self.moe_layers() if moe.has_aux_loss]  # not Cells: no child
        self.loss_part_names = ((["lm_loss", *self._mtp_loss_names] if self.mtp is not None or config.has_moe else [])
                                + (["load_balancing_loss"] if self._aux_loss_stats else []))
        # tensor parallelism replaces these: the collective bringing the hidden states to the (vocab-parallel)
        # output layer, and the per-token loss of logits over this rank's part of the vocabulary
        self.output_input_comm = None
        self.token_loss = token_cross_entropy
        # context parallelism replaces it: the loss tokens of the micro-batch's whole samples, summed over the
        # ranks holding their other segments, so each rank's loss is its part of the micro-batch mean
        self.count_loss_tokens = None
        # and this: MTP's one-token moves of (ids, labels, loss_mask), whose next token may be another rank's
        self.roll_inputs_left = roll_each_left
        # MindFormers drops the embedding output too (in MTP depths alike); every Dropout draws from one stream
        self.embedding_dropout = Dropout(config.hidden_dropout)
        self.dropout_masks = MaskStream(seed)
        for _, cell in self.cells_and_names():
            if isinstance(cell, Dropout):
                cell.stream = self.dropout_masks
        # drawn in fp32 (the same seeded stream for every dtype), then stored as model.params_dtype; AdamW
        # updates low-precision params through fp32 masters
        for param in self.get_parameters():
            if param.requires_grad:  # MoE bookkeeping buffers stay fp32
                param.set_dtype(config.dtype("params_dtype"))

    # ---- forward -----------------------------------------------------------------------------
    def _tables(self, seq: int, position_ids: Tensor | None, attention_mask: Tensor | None):
        """The rotary tables and the additive mask of a [batch, seq] micro-batch (every pipeline stage makes its
        own: only hidden states travel between stages)."""
        if seq > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {seq} exceeds model.max_position_embeddings "
                             f"({self.config.max_position_embeddings})")
        cos, sin = self.rotary.tables(seq, position_ids)
        mask = (causal_mask(seq, self.mask_repeats) if attention_mask is None
                else additive_mask(attention_mask, self.mask_repeats))
        return cos, sin, mask

    def _embed(self, input_ids: Tensor) -> Tensor:
        return cast(self.embedding_dropout(self.embedding(input_ids)), self.compute_dtype)

    def _decode(self, input_ids: Tensor, position_ids: Tensor | None, attention_mask: Tensor | None):
        cos, sin, mask = self._tables(input_ids.shape[1], position_ids, attention_mask)
        return self.decoder(self._embed(input_ids), cos, sin, mask), cos, sin, mask

    def _output(self, hidden: Tensor) -> Tensor:
        if self.output_input_comm is not None:
            hidden = self.output_input_comm(hidden)
        if self.output_layer is None:
            logits = self.embedding.word_embeddings.as_output_layer(hidden)
        else:
            logits = self.output_layer(hidden)
        return cast(logits, ms.float32)

    def _masked_mean_loss(self, logits: Tensor, labels: Tensor, loss_mask: Tensor) -> Tensor:
        token_loss = self.token_loss(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        mask = cast(loss_mask.reshape(-1), ms.float32)
        # after the loss (ops.depend): in a compiled step every rank must reach context parallelism's collectives
        # in one order, and the count, needing only the data, could otherwise run before the attention's
        count = mask.sum() if self.count_loss_tokens is None else self.count_loss_tokens(ops.depend(mask.sum(),
                                                                                                    token_loss))
        return (token_loss * mask).sum() / count.clamp(min=1.0)

    def sample_loss_sums(self, input_ids: Tensor, labels: Tensor, loss_mask: Tensor,
                         position_ids: Tensor | None = None, attention_mask: Tensor | None = None
                         ) -> tuple[Tensor, Tensor]:
        """Each sample's summed LM loss over its loss-masked tokens, and how many tokens those are ([batch]
        each): held-out loss is averaged over tokens across batches and ranks, which a per-batch mean cannot
        give. The main head only (no MTP depth, no load-balancing term), as Megatron's validation loss."""
        return self.hidden_loss_sums(self._decode(input_ids, position_ids, attention_mask)[0], labels, loss_mask)

    def hidden_loss_sums(self, hidden: Tensor, labels: Tensor, loss_mask: Tensor) -> tuple[Tensor, Tensor]:
        """``sample_loss_sums`` from the decoder's output ``hidden`` (after its final norm): what the last
        pipeline stage computes of it."""
        logits = self._output(hidden)
        token_loss = self.token_loss(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        mask = cast(loss_mask, ms.float32)
        return (token_loss.reshape(mask.shape) * mask).sum(-1), mask.sum(-1)

    def target_losses(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor, target_index: Tensor,
                      target_labels: Tensor) -> Tensor:
        """-log p(``target_labels[i]``) predicted at flat position ``target_index[i]`` of the [batch·seq]
        positions ([targets] each): the output layer runs on those positions only, so a scorer that needs a few
        tokens' likelihoods (downstream tasks: the answers', not the prompt's) does not pay for the others'."""
        hidden = self._decode(input_ids, position_ids, attention_mask)[0]
        hidden = ops.gather(hidden.reshape(-1, hidden.shape[-1]), target_index, 0)
        return self.token_loss(self._output(hidden), target_labels)

    def logits(self, input_ids: Tensor, position_ids: Tensor | None = None,
               attention_mask: Tensor | None = None) -> Tensor:
        """[batch, seq] token ids → [batch, seq, vocab] fp32 logits. Without ``position_ids`` positions
        are 0..seq-1; without ``attention_mask`` ([batch, 1, seq, seq], 1 = masked) attention is causal.
        Under tensor parallelism: this rank's slice of the vocabulary only."""
        return self._output(self._decode(input_ids, position_ids, attention_mask)[0])

    def construct(self, input_ids: Tensor, labels: Tensor, loss_mask: Tensor, position_ids: Tensor | None = None,
                  attention_mask: Tensor | None = None) -> Tensor:
        return self.loss_and_parts(input_ids, labels, loss_mask, position_ids, attention_mask)[0]

    def loss_and_parts(self, input_ids: Tensor, labels: Tensor, loss_mask: Tensor, position_ids: Tensor | None = None,
                       attention_mask: Tensor | None = None) -> tuple[Tensor, tuple[Tensor, ...]]:
        """The training loss and its parts named by ``loss_part_names`` (no gradient through them), as outputs: a
        compiled step returns them per micro-batch, so nothing of a forward is kept on the model for the log."""
        hidden, cos, sin, mask = self._decode(input_ids, position_ids, attention_mask)
        if not self.loss_part_names:
            return self._masked_mean_loss(self._output(hidden), labels, loss_mask), ()
        loss, components = self.head_loss(hidden, input_ids, labels, loss_mask, cos, sin, mask)
        if self._aux_loss_stats:
            # values only: each layer's AuxLossGradient gives the load-balancing losses their gradients
            balancing = self._aux_loss_stats[0].aux_loss
            for stats in self._aux_loss_stats[1:]:
                balancing = balancing + stats.aux_loss
            components["load_balancing_loss"] = balancing
            loss = loss + balancing
        return loss, tuple([ops.stop_gradient(components[name]) for name in self.loss_part_names])

    def head_loss(self, hidden: Tensor, input_ids: Tensor, labels: Tensor, loss_mask: Tensor, cos: Tensor,
                  sin: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of the decoder's output ``hidden`` (after its final norm): the LM loss plus the MTP depths'
        scaled mean, and the parts (lm_loss, mtp_{k}_loss); the load-balancing losses are the caller's."""
        loss = self._masked_mean_loss(self._output(hidden), labels, loss_mask)
        components = {"lm_loss": loss}
        if self.mtp is not None:
            # depth k predicts token i+k+1 from position i: inputs, labels and mask move left once per depth
            depth_losses, ids = [], input_ids
            for k, layer in enumerate(self.mtp.layers):
                # after the hidden states, as the loss's token count (context parallelism gathers here)
                ids, labels, loss_mask = self.roll_inputs_left(ops.depend(ids, hidden), labels, loss_mask)
                hidden = layer(self._embed(ids), hidden, cos, sin, mask)
                depth_losses.append(self._masked_mean_loss(self._output(hidden), labels, loss_mask))
                components[self._mtp_loss_names[k]] = depth_losses[-1]
            loss = loss + self.config.mtp_loss_scale * sum(depth_losses) / len(depth_losses)
        return loss, components

    def named_parts(self, parts: tuple) -> dict[str, float]:
        """``loss_and_parts``' parts by name, as floats (a host sync)."""
        return {name: float(value.asnumpy()) for name, value in zip(self.loss_part_names, parts)}

    def set_loss_scale(self, scale: float) -> None:
        """The factor on the loss that gradients are taken of (``ScaledLoss.scale``), which the load-balancing
        losses' gradients carry too (``AuxLossGradient``)."""
        for _, moe in self.moe_layers():
            moe.aux_loss_gradient.loss_scale = scale

    # ---- structure -----------------------------------------------------------------------------
    def transformer_layers(self) -> list[tuple[str, TransformerLayer]]:
        """(name, layer) of every transformer layer: the decoder's, then each MTP depth's (cut alike by every
        parallelism, as in MindFormers)."""
        layers = [(f"decoder.layers.{i}", layer) for i, layer in enumerate(self.decoder.layers)]
        if self.mtp is not None:
            layers += [(f"mtp.layers.{k}", layer.transformer_layer) for k, layer in enumerate(self.mtp.layers)]
        return layers

    # ---- MoE bookkeeping ---------------------------------------------------------------------
    def moe_layers(self) -> list[tuple[str, MoELayer]]:
        """(layer name, its MoELayer) for every MoE layer, decoder first, then MTP depths."""
        return [(name, layer.mlp) for name, layer in self.transformer_layers() if isinstance(layer.mlp, MoELayer)]

    def after_step(self, collectives, applied: bool = True) -> dict[str, list[int]]:
        """After an optimizer step: sum every MoE layer's tokens-per-expert counts over the ranks (one AllReduce
        over the world for all layers), nudge the expert biases toward balance (aux-loss-free
        balancing; only when the update was ``applied``) and zero the counts. Returns the step's counts."""
        moe = self.moe_layers()
        if not moe:
            return {}
        local = np.stack([layer.take_counts() for _, layer in moe])
        total = collectives.all_reduce_array(local.astype(np.float32)).astype(np.int64)
        if applied:
            for (_, layer), counts in zip(moe, total):
                layer.update_expert_bias(counts)
        return {name: counts.tolist() for (name, _), counts in zip(moe, total)}

    # ---- parallel plan: how each parallelism of training.parallel cuts this model -------------------------
    def check_tensor_parallel(self, tp) -> None:
        """What tensor parallelism needs of this model: its config says (GPTConfig.check_tensor_parallel)."""
        self.config.check_tensor_parallel(tp)

    def parallelize_tensor(self, tp) -> None:
        """Tensor parallelism's cut: the vocabulary rows of the embedding and of the output layer (a tied output
        layer uses the embedding's), the hidden states' collective into the output layer, the vocab-parallel loss;
        then each transformer layer's own cut."""
        embedding = self.embedding.word_embeddings
        embedding.parallelize_tensor(tp)
        if self.output_layer is not None:
            tp.cut(self.output_layer, "weight", 0)
        self.output_input_comm = tp.enter
        self.token_loss = tp.vocab_parallel_cross_entropy(embedding.vocab_start)
        for _, layer in self.transformer_layers():
            layer.parallelize_tensor(tp)

    def parallelize_experts(self, ep) -> None:
        """Expert parallelism's cut (``ep``: training.parallel.expert_parallel.ExpertParallel): every MoE layer's."""
        moe = [layer for _, layer in self.moe_layers()]
        ep.require_experts(moe[0].num_experts if moe else None)
        for layer in moe:
            layer.parallelize_experts(ep)

    def parallelize_context(self, cp) -> None:
        """Context parallelism (``cp``: training.parallel.context_parallel.ContextParallelPlan): every attention
        layer's core over the cp ranks' tokens, the loss's token count over them, MTP's one-token moves across
        their sequence segments, and each MoE layer's balancing statistics over them."""
        for attention in self._attentions():
            attention.parallelize_context(cp)
        self.count_loss_tokens = cp.loss_token_count()
        self.roll_inputs_left = cp.move_left()
        for _, moe in self.moe_layers():
            moe.parallelize_context(cp)

    def sharding_units(self, pipelined: bool) -> list[nn.Cell]:
        """What FSDP gathers as one: each decoder and MTP layer, and the model itself for the rest (embedding,
        final norm, output layer), as MindFormers wraps them; outermost first. A pipeline stage calls the
        embedding, the final norm and the output layer itself, not the model: under pipeline parallelism they
        are the units."""
        root = [self]
        if pipelined:
            root = [self.embedding, self.decoder.final_layernorm] + (
                [self.output_layer] if self.output_layer is not None else [])
        return [*root, *self.decoder.layers, *(self.mtp.layers if self.mtp is not None else [])]

    def unit_entry_points(self, unit: nn.Cell) -> tuple[str, ...]:
        """The methods of this model, besides ``unit.construct``, that read the weights of the sharding unit
        ``unit``, so ZeRO-3 gathers them for those calls too: the training loss with its parts, the inference
        logits and validation's loss sums for the model itself; and, when the embedding is a unit of its own (a
        pipeline stage) and the output layer is tied to it, the output matmul."""
        if unit is self:
            return ("loss_and_parts", "logits", "sample_loss_sums")
        return ("_output",) if self.output_layer is None and unit is self.embedding else ()

    @property
    def pipeline_layers(self) -> int:
        """How many layers the pipeline stages split among them (the decoder's; see ``pipeline_stage``)."""
        return len(self.decoder.layers)

    def pipeline_stage(self, layers: range, first: bool, last: bool) -> "PipelineStage":
        """The pipeline stage of decoder ``layers``, the first and/or the last stage of the model."""
        return PipelineStage(self, layers, first, last)

    # ---- monitoring and accounting -----------------------------------------------------------
    def _attentions(self):
        return [layer.self_attention for _, layer in self.transformer_layers()]

    def track_max_attention_logits(self, enabled: bool) -> None:
        """Record each layer's per-head max attention logit from now on (costs one reduction per layer)."""
        for attention in self._attentions():
            attention.logit_tracker.enabled = enabled

    def pop_max_attention_logits(self) -> np.ndarray | None:
        """[layers, heads] maxima since the last pop (None if nothing was tracked); resets them."""
        maxima = [attention.logit_tracker.pop() for attention in self._attentions()]
        return None if any(m is None for m in maxima) else np.stack(maxima)

    def num_parameters(self) -> int:
        return sum(int(np.prod(p.shape)) for p in self.trainable_params())

    def flops_per_token(self, seq_length: int) -> float:
        """Training FLOPs per token, Megatron/PaLM style: 6·N for the weight matmuls a token passes through
        (forward + backward) plus 6·heads·(qk_dim + v_dim)·seq per attention layer for QKᵀ and
        attention·V (no discount for the causal mask). N excludes the input embedding table unless it is
        also the (tied) output matmul, counts only the routed experts a token visits (top-k of E), and
        counts the output layer once more per MTP depth."""
        c = self.config
        matmul_params = self.num_parameters()
        if not c.tie_word_embeddings:
            matmul_params -= c.vocab_size * c.hidden_size
        for _, moe in self.moe_layers():
            matmul_params -= moe.expert_parameters() * (1 - moe.top_k / moe.num_experts)
        matmul_params += c.num_mtp_layers * c.vocab_size * c.hidden_size
        heads, qk_dim, v_dim = c.attention_dims()
        attention = 6 * (c.num_hidden_layers + c.num_mtp_layers) * heads * (qk_dim + v_dim) * seq_length
        return float(6 * matmul_params + attention)


class ReplayState:
    """What a forward changes besides its output: the model's dropout stream and the token counts of ``moe`` (its MoE
    layers concerned). A forward replayed in a backward (a pipeline stage's, a recomputed part's) rewinds the stream
    to draw the forward's masks again, and drops the replay's counts."""

    def __init__(self, model: GPTModel, moe: list[MoELayer]):
        self.stream, self.moe = model.dropout_masks, moe

    def capture(self) -> tuple:
        return self.stream.state(), [moe.token_counts for moe in self.moe]

    def rewind(self, state: tuple) -> None:
        """The dropout stream back to ``state``'s (a replay draws the forward's masks again)."""
        self.stream.set_state(state[0])

    def restore(self, state: tuple) -> None:
        """The dropout stream and the token counts back to ``state``'s (after a replay)."""
        self.rewind(state)
        for moe, counts in zip(self.moe, state[1]):
            moe.token_counts = counts


class PipelineStage:
    """One pipeline stage of a GPTModel, what training.parallel.pipeline runs, replays and differentiates: decoder
    ``layers``; the embedding on the ``first`` stage; on the ``last`` one the final norm, the output layer, the loss
    and the MTP depths, with the embedding again when the MTP depths embed or the output layer is tied to it (both
    copies start equal, and the pipeline sums the gradients of a tensor two stages hold)."""

    def __init__(self, model: GPTModel, layers: range, first: bool, last: bool):
        self.model, self.first, self.last = model, first, last
        self.layers = [model.decoder.layers[i] for i in layers]
        self.cells: list[nn.Cell] = list(self.layers)
        if first:
            self.cells.append(model.embedding)
        if last:
            self.cells += [model.decoder.final_layernorm] + (
                [model.output_layer] if model.output_layer is not None else [])
            if model.mtp is not None:
                self.cells.append(model.mtp)
            if model.mtp is not None or model.output_layer is None:
                self.cells.append(model.embedding)
        mtp_layers = [layer.transformer_layer for layer in model.mtp.layers] if last and model.mtp is not None else []
        self.moe = [layer.mlp for layer in self.layers + mtp_layers if isinstance(layer.mlp, MoELayer)]
        self.replay = ReplayState(model, self.moe)
        balancing = any(moe.has_aux_loss for moe in self.moe)
        # this stage's part of the loss and, of the model's named parts, those it gives
        self.holds_loss = last or balancing
        self.part_names = [name for name in model.loss_part_names
                           if (balancing if name == "load_balancing_loss" else last)]
        # what a stage sends on: hidden states [batch, seq, hidden] in the compute dtype
        self.hidden_size, self.dtype = model.config.hidden_size, model.compute_dtype

    def decode(self, x, input_ids, position_ids, attention_mask) -> tuple[Tensor, tuple]:
        """The stage's decoder layers over ``x`` (over the embedded tokens on the first stage), and the rotary
        tables and the mask they read (each stage makes its own)."""
        tables = self.model._tables(input_ids.shape[1], position_ids, attention_mask)
        if self.first:
            x = self.model._embed(input_ids)
        for layer in self.layers:
            x = run_layer(layer, x, *tables)
        return x, tables

    def forward(self, x, input_ids, labels, loss_mask, position_ids, attention_mask):
        """(output hidden states, or None on the last stage; this stage's part of the loss, or None; its parts by
        name)."""
        model = self.model
        x, tables = self.decode(x, input_ids, position_ids, attention_mask)
        components = {}
        loss = None
        if self.last:
            loss, components = model.head_loss(model.decoder.final_layernorm(x), input_ids, labels, loss_mask,
                                               *tables)
            x = None
        aux = [moe.aux_loss for moe in self.moe if moe.aux_loss is not None]
        if aux:
            components["load_balancing_loss"] = sum(aux)
            loss = components["load_balancing_loss"] if loss is None else loss + components["load_balancing_loss"]
        return x, loss, components

    def held_out_loss_sums(self, x, labels, loss_mask) -> tuple[Tensor, Tensor]:
        """The last stage's validation sums (``GPTModel.hidden_loss_sums``) of its decoded ``x``."""
        return self.model.hidden_loss_sums(self.model.decoder.final_layernorm(x), labels, loss_mask)

