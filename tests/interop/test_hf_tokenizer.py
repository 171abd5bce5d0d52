"""`kiln export-hf` writes the tokenizer the checkpoint trained with: `AutoTokenizer` on the export encodes text to
Kiln's ids (sentencepiece's, as `kiln preprocess` writes them) and decodes them back; the tokenizer file is verified
against the sha256 the checkpoint's lineage recorded."""
from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from interop.hf_helpers import kiln_model, model_section
from training.checkpoint import save_checkpoint
from training.cli import main
from training.data.encoding import load_sentencepiece
from training.data.hashing import sha256_file
from training.parallel.comm import Collectives
from training.parallel.mesh import World

CONFIG = "tests/configs/qwen3_micro.yaml"
STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    """A tokenizer trained as the tokenizer asset trains one, on 40 stdlib modules."""
    from resources.tokenizer import TokenizerSettings

    root = tmp_path_factory.mktemp("tokenizer")
    documents = [p.read_text(errors="replace") for p in sorted(STDLIB.glob("*.py"))[:40]]
    TokenizerSettings(vocab_size=2000).train(documents, root / "data" / "tokenizer" / "kiln")
    return root / "data" / "tokenizer" / "kiln.model"


@pytest.fixture
def checkpoint(tmp_path, tokenizer) -> Path:
    """A checkpoint whose lineage names the tokenizer (relative to its data root), as training_run records it."""
    section = model_section(CONFIG)
    _, weights = kiln_model(section, seed=1)
    world = World(rank=0, size=1)
    data_root = tokenizer.parent.parent
    lineage = {"data_root": str(data_root), "run": {"config": {"model": section}},
               "tokenizer": {"path": "tokenizer/kiln.model", "sha256": sha256_file(tokenizer)}}
    saved = save_checkpoint(save_path=tmp_path / "run", step=1, model=weights, optim=None,
                            common={"global_step": 1, "consumed_samples": 4, "global_batch_size": 4},
                            lineage=lineage, prefix=None, save_max=1, world=world, collectives=Collectives(world))
    return saved.path


def texts() -> list[str]:
    """Prose, code with indentation and digits, non-Latin text and emoji (byte fallback), leading spaces, and
    stdlib modules the tokenizer never saw."""
    return (["hello world", "def f(x):\n    return x + 12345\n", "  leading  spaces\t tab", "émoji 🙂 and 中文",
             "a\n\n\nb", " ", ""] + [p.read_text(errors="replace")[:4000] for p in sorted(STDLIB.glob("*.py"))[60:100]])


def test_autotokenizer_on_the_export_gives_kilns_ids(checkpoint, tokenizer, tmp_path, capsys, transformers):
    assert main(["export-hf", str(checkpoint), str(tmp_path / "hf")]) == 0
    assert "WARNING" not in capsys.readouterr().err
    assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == tokenizer.read_bytes()
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    kiln = load_sentencepiece(tokenizer)
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, hf.unk_token_id) == (
        kiln.bos_id(), kiln.eos_id(), kiln.pad_id(), kiln.unk_id())
    assert hf("hello world").input_ids == kiln.encode("hello world")  # no bos/eos added
    ties = 0
    for text in texts():
        ours, theirs = kiln.encode(text), hf(text, add_special_tokens=False).input_ids
        assert hf.decode(theirs) == text
        if ours != theirs:  # only a tie: another segmentation of the same text with the same total score
            ties += 1
            assert kiln.decode(theirs) == text
            assert sum(map(kiln.get_score, theirs)) == pytest.approx(sum(map(kiln.get_score, ours)), abs=1e-3)
    assert ties <= 2  # ties are rare: runs of one repeated character, such as a line of "="


def test_the_exported_tokenizer_is_the_one_the_lineage_recorded(checkpoint, tokenizer, tmp_path, capsys):
    moved = tmp_path / "moved"
    tokenizer.parent.parent.rename(moved)
    try:
        assert main(["export-hf", str(checkpoint), str(tmp_path / "hf")]) == 2
        err = capsys.readouterr().err
        assert "kiln.model: the tokenizer" in err and "pass --data-root DIR" in err
        assert main(["export-hf", str(checkpoint), str(tmp_path / "hf"), "--data-root", str(moved)]) == 0
        capsys.readouterr()
        original = (moved / "tokenizer" / "kiln.model").read_bytes()
        (moved / "tokenizer" / "kiln.model").write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        assert main(["export-hf", str(checkpoint), str(tmp_path / "hf2"), "--data-root", str(moved)]) == 2
        assert "kiln.model: sha256" in capsys.readouterr().err
        (moved / "tokenizer" / "kiln.model").write_bytes(original)
    finally:
        moved.rename(tokenizer.parent.parent)
