"""Each model owns its parallel plan: training/parallel is generic code that imports no model class, and a model
defined in the tests (tests/plain_gpt.py) declares its own cuts. Its training under tensor parallelism, ZeRO-3 and
pipeline parallelism is proven against one process in tests/test_fsdp.py and tests/test_pipeline.py (their msrun
launches); here, without msrun, what its plan refuses, and its gradients."""
import ast
import importlib
import inspect
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor

from conftest import PROJECT_ROOT
from plain_gpt import PlainGPTConfig
from test_tensor_parallel import TwoRankMesh
from training.config import ConfigError
from training.model.gpt import GPTModel
from training.parallel.tensor_parallel import apply_tensor_parallel

ms.set_context(mode=ms.PYNATIVE_MODE)
ms.set_device("CPU")

PLAIN = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, head_dim=8, seq_length=8, max_position_embeddings=16, compute_dtype="float32",
             hidden_dropout=0.0)


def imports_from_the_models(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every name ``path`` imports from training.model (name "*" for a whole module)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and (
                node.module == "training.model" or node.module.startswith("training.model.")):
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "training" and any(
                alias.name == "model" for alias in node.names):
            found.append(("training.model", "*"))
        elif isinstance(node, ast.Import):
            found += [(alias.name, "*") for alias in node.names if alias.name.startswith("training.model")]
    return found


def test_training_parallel_imports_no_model_class():
    """Every module under training/parallel: what it takes from training.model is functions (ops such as
    ``linear`` or ``cast``), never a model class nor a whole model module."""
    modules = sorted((PROJECT_ROOT / "training/parallel").glob("*.py"))
    assert len(modules) >= 9
    for path in modules:
        for module, name in imports_from_the_models(path):
            assert name != "*", f"{path.name} imports the module {module}"
            value = getattr(importlib.import_module(module), name)
            assert not inspect.isclass(value), f"{path.name} imports the class {module}.{name}"
            assert callable(value), f"{path.name} imports {module}.{name}, which is not a function"


def test_the_import_check_finds_a_model_class(tmp_path):
    """The check above sees the kinds of import it forbids."""
    source = tmp_path / "parallel_module.py"
    source.write_text("from training.model.moe import MoELayer, scale_rows\nimport training.model.gpt\n"
                      "from training import model\n")
    assert imports_from_the_models(source) == [("training.model.moe", "MoELayer"), ("training.model.moe", "scale_rows"),
                                               ("training.model.gpt", "*"), ("training.model", "*")]
    assert inspect.isclass(importlib.import_module("training.model.moe").MoELayer)


@pytest.mark.parametrize("changes, message", [
    ({"num_attention_heads": 3, "num_key_value_heads": 3, "hidden_size": 24},
     r"parallelism\.tensor_parallel \(2\) must divide model\.num_attention_heads \(3\): q, k and v are split by "
     r"whole heads"),
    ({"intermediate_size": 31}, r"must divide model\.intermediate_size \(31\)"),
])
def test_the_plain_models_own_plan_refuses_what_it_cannot_split(changes, message):
    with pytest.raises(ConfigError, match=message):
        apply_tensor_parallel(GPTModel(PlainGPTConfig.from_dict({**PLAIN, **changes}), seed=0), TwoRankMesh(), True)


def test_the_plain_models_gradients_match_finite_differences():
    """Its layers are hand-written for the test (attention, LayerNorm, MLP): autograd's gradient of the loss
    against central differences in float64 arithmetic of the float32 loss, for some entries of each tensor kind."""
    model = GPTModel(PlainGPTConfig.from_dict(PLAIN), seed=3)
    rng = np.random.default_rng(0)
    ids = Tensor(rng.integers(0, 64, (2, 8)).astype(np.int32))
    labels = Tensor(rng.integers(0, 64, (2, 8)).astype(np.int32))
    mask = Tensor(np.ones((2, 8), np.float32))
    params = {p.name: p for p in model.trainable_params()}
    names = ["decoder.layers.0.input_layernorm.weight", "decoder.layers.0.input_layernorm.bias",
             "decoder.layers.0.self_attention.linear_q.weight", "decoder.layers.0.self_attention.linear_k.bias",
             "decoder.layers.1.self_attention.linear_v.weight", "decoder.layers.1.mlp.linear_fc1.bias",
             "decoder.layers.1.self_attention.linear_proj.weight", "decoder.layers.1.pre_mlp_layernorm.bias"]
    grads = ms.grad(model, grad_position=None, weights=[params[n] for n in names])(ids, labels, mask)
    step = 1e-2
    for name, grad in zip(names, grads):
        param = params[name]
        base = param.asnumpy().copy()
        for index in list(np.ndindex(base.shape))[:3]:
            values = []
            for delta in (step, -step):
                moved = base.copy()
                moved[index] += delta
                param.set_data(Tensor(moved))
                values.append(float(model(ids, labels, mask).asnumpy()))
            param.set_data(Tensor(base))
            numeric = (values[0] - values[1]) / (2 * step)
            assert grad.asnumpy()[index] == pytest.approx(numeric, rel=2e-2, abs=2e-4), (name, index)
