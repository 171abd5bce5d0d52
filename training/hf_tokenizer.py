"""Kiln's sentencepiece tokenizer as Hugging Face files: the ``tokenizer.model`` itself (for sentencepiece-backed
classes) and a ``tokenizer.json`` that ``AutoTokenizer`` loads with no conversion, giving the ids Kiln trained on.

The tokenizer.json is written from the model's own pieces and scores: a Unigram model with byte fallback (Kiln
trains ``byte_fallback=True``), under the normalization sentencepiece applies with the identity rule and its
dummy prefix: a "▁" before the text and every space as "▁", nothing else changed (extra whitespace kept). The
sentencepiece trainer's splitting options (whitespace, digits, scripts) only limit which pieces exist, so the
Viterbi search over the whole text finds the same pieces, up to ties: two segmentations of equal score (e.g.
a run of 23 "=" as 14 + 9 or 9 + 14) may be broken the other way, as sentencepiece adds float32 scores and the
tokenizers library float64. The special tokens' text ("</s>") in an input is their id to transformers, text to
sentencepiece. A model normalized otherwise (a rule such as nmt_nfkc,
or extra whitespace removed) is refused: its precompiled normalization has no exact tokenizer.json equivalent here.
"""
from __future__ import annotations

import json

import sentencepiece
from sentencepiece import sentencepiece_model_pb2

SPACE = "\u2581"  # sentencepiece's visible space
# sentencepiece piece types (ModelProto.SentencePiece.Type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


class TokenizerExportError(ValueError):
    """A sentencepiece model that cannot be written as an equivalent tokenizer.json; the message says why."""


def hf_tokenizer_files(model_bytes: bytes, where: str) -> dict[str, bytes]:
    """File name -> bytes of the Hugging Face tokenizer for the sentencepiece model ``model_bytes`` (``where``
    names it in errors): tokenizer.model, tokenizer.json, tokenizer_config.json, special_tokens_map.json."""
    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(model_bytes)
    except Exception as exc:  # noqa: BLE001 -- protobuf's DecodeError, named with the file
        raise TokenizerExportError(f"{where}: not a sentencepiece model ({exc})") from None
    normalizer, trainer = proto.normalizer_spec, proto.trainer_spec
    if trainer.model_type != sentencepiece_model_pb2.TrainerSpec.UNIGRAM or not trainer.byte_fallback:
        raise TokenizerExportError(f"{where}: a {sentencepiece_model_pb2.TrainerSpec.ModelType.Name(trainer.model_type)}"
                                   f" model{'' if trainer.byte_fallback else ' without byte_fallback'}; the export "
                                   f"writes the unigram, byte-fallback models Kiln trains")
    if normalizer.name != "identity" or normalizer.remove_extra_whitespaces or not normalizer.escape_whitespaces \
            or trainer.treat_whitespace_as_suffix:
        raise TokenizerExportError(f"{where}: normalization {normalizer.name!r} (remove_extra_whitespaces "
                                   f"{normalizer.remove_extra_whitespaces}) has no exact tokenizer.json equivalent; "
                                   f"the export writes models trained with the identity rule, as Kiln trains them")
    processor = sentencepiece.SentencePieceProcessor(model_proto=model_bytes)
    special = {kind: processor.id_to_piece(index) for kind, index in (
        ("unk_token", processor.unk_id()), ("bos_token", processor.bos_id()), ("eos_token", processor.eos_id()),
        ("pad_token", processor.pad_id())) if index >= 0}
    added = [{"id": i, "content": piece.piece, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True}
             for i, piece in enumerate(proto.pieces) if piece.type in (_UNKNOWN, _CONTROL)]
    steps = ([{"type": "Prepend", "prepend": SPACE}] if normalizer.add_dummy_prefix else []) + [
        {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}]
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": steps},
        "pre_tokenizer": None,
        "model": {"type": "Unigram", "unk_id": processor.unk_id(), "byte_fallback": True,
                  "vocab": [[piece.piece, piece.score] for piece in proto.pieces]},
        "post_processor": None,
        # ids back to text: "▁" to spaces, byte pieces to bytes, the dummy prefix's space dropped
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": SPACE}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}] + ([{"type": "Strip", "content": " ", "start": 1, "stop": 0}]
                                 if normalizer.add_dummy_prefix else [])},
    }
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "add_bos_token": False,
              "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "model_max_length": int(1e30)}  # transformers' "no limit"; the model's config.json has its own
    return {"tokenizer.model": model_bytes,
            "tokenizer.json": json.dumps(tokenizer, ensure_ascii=False).encode(),
            "tokenizer_config.json": json.dumps(config, indent=2).encode(),
            "special_tokens_map.json": json.dumps(special, indent=2).encode()}
