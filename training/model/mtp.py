"""Multi-token prediction (DeepSeek-V3): depth k predicts the token k+1 ahead of each position from the
previous depth's hidden state and the embedding of the token k ahead; embedding and output layer are
the main model's (GPTModel runs the depths and their losses)."""
from __future__ import annotations

from mindspore import Tensor, nn, ops

from training.model.layers import Init, Linear, RMSNorm
from training.model.spec import ModuleSpec, build_module
from training.model.transformer import run_layer


class MultiTokenPredictionLayer(nn.Cell):
    """final_layernorm(layer(eh_proj([enorm(embedding); hnorm(hidden)]))): embedding first in the
    concatenation, as Megatron and vLLM read DeepSeek-V3's ``eh_proj`` [hidden, 2·hidden]."""

    def __init__(self, init: Init, config, transformer_layer: ModuleSpec):
        super().__init__()
        norm_dtype = config.dtype("layernorm_compute_dtype")
        self.enorm = RMSNorm(config.hidden_size, config.rms_norm_eps, norm_dtype)
        self.hnorm = RMSNorm(config.hidden_size, config.rms_norm_eps, norm_dtype)
        self.eh_proj = Linear(init, 2 * config.hidden_size, config.hidden_size)
        self.transformer_layer = build_module(transformer_layer, init, config)
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, norm_dtype)

    def construct(self, embedded: Tensor, hidden: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        x = self.eh_proj(ops.cat((self.enorm(embedded), self.hnorm(hidden)), axis=-1))
        return self.final_layernorm(run_layer(self.transformer_layer, x, cos, sin, mask))


class MultiTokenPredictionBlock(nn.Cell):
    def __init__(self, init: Init, config, layer_spec: ModuleSpec):
        super().__init__()
        self.layers = nn.CellList([MultiTokenPredictionLayer(init, config, layer_spec)
                                   for _ in range(config.num_mtp_layers)])
