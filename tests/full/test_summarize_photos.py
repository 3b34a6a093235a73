"""End-to-end tests of scripts/summarize_photos.py (stage A) on the embedded tiny Qwen2.5-VL, on the CPU.

The folder trees are generated in tmp_path. Each summary is checked against an independent reference (the
model asked about that photo alone, through transformers' `generate`); resuming is checked with a torn line
written by hand and with a process that dies in the middle of writing a line; the last test trains stage B
(trainer.main) on the file stage A wrote, unconverted.
"""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

import data
import grpo
import model_io
from full.helpers import train_args
from grpo_vlm import cli, tasks, trainer
from scripts import summarize_photos as sp

ROOT = Path(__file__).resolve().parents[2]
COLOURS = list(data.COLOURS.values())

# Created in this (scrambled) order; a plain sort would put img10-img12 before IMG2 and upper case first.
NATURAL_ORDER = [
    "img1.jpg",
    "IMG2.png",
    "img3.JPEG",
    "Img4.jpg",
    "img5.png",
    "IMG6.jpg",
    "img7.jpeg",
    "img8.PNG",
    "img9.jpg",
    "img10.JPG",
    "IMG11.png",
    "img12.jpeg",
]


def photo(path: Path, colour_index: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.new("RGB", (56, 56), (235, 235, 235))
    ImageDraw.Draw(image).rectangle((10, 10, 45, 45), fill=COLOURS[colour_index % len(COLOURS)])
    image.save(path)


def tree(root: Path, groups: dict[str, list[str]]) -> Path:
    """root/<group>/<name> photos, each a square of another colour (so the summaries differ)."""
    for group, names in groups.items():
        (root / group).mkdir(parents=True, exist_ok=True)
        for i, name in enumerate(names):
            photo(root / group / name, i)
    return root


def small_args(tmp_path: Path, photos: Path, **overrides) -> sp.Args:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(tasks.SHAPES_PROMPT + "\n", encoding="utf-8")  # the question the tiny model knows
    settings = dict(
        photos=str(photos),
        prompt_template=str(prompt),
        output=str(tmp_path / "out" / "summaries.jsonl"),
        device="cpu",
        batch_size=4,
        max_new_tokens=16,
    )
    return sp.Args(**(settings | overrides))


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines()]


def two_groups(tmp_path: Path) -> Path:
    return tree(tmp_path / "photos", {"site1": ["a1.jpg", "a2.jpg"], "site2": ["b1.png", "b2.png", "b3.png"]})


# --------------------------------------------------------------------------------------------------
# Grouping and order


def test_each_sub_folder_is_one_line_with_one_summary_per_photo_in_natural_order(tmp_path):
    photos = tree(tmp_path / "photos", {"site2": NATURAL_ORDER[::-1], "site10": ["p1.png"]})
    (photos / "site2" / "notes.txt").write_text("not a photo")
    (photos / "site2" / "._img1.jpg").write_bytes(b"macOS resource fork, not an image")  # hidden: ignored
    stats = sp.main(small_args(tmp_path, photos))

    out = lines(tmp_path / "out" / "summaries.jsonl")
    assert [r["group_id"] for r in out] == ["site2", "site10"]  # groups in natural order too
    site2 = out[0]
    assert site2["photos"] == [f"../photos/site2/{name}" for name in NATURAL_ORDER]
    assert list(site2) == ["group_id", "id", "prompt", "summaries", "photos", "truncated"]  # no --labels
    assert site2["id"] == "site2" and site2["prompt"] == sp.DEFAULT_STAGE_B_PROMPT
    assert len(site2["summaries"]) == 12 and all(s.strip() and "\n" not in s for s in site2["summaries"])
    assert len(site2["truncated"]) == 12
    assert stats["written"] == 2 and stats["photos_summarised"] == 13 and stats["other_files"] == 2


def test_each_summary_is_the_models_answer_about_its_own_photo_alone(tmp_path):
    photos = tree(tmp_path / "photos", {"g": [f"p{i}.png" for i in range(1, 5)]})
    sp.main(small_args(tmp_path, photos, batch_size=3))  # a batch boundary inside the group
    summaries = lines(tmp_path / "out" / "summaries.jsonl")[0]["summaries"]

    # Reference: each photo alone, through transformers' generate (grpo.sample_completions), greedy.
    model, tokenizer, image_processor = model_io.load_model(
        model_io.DEFAULT_MODEL, device="cpu", dtype=torch.float32
    )
    expected = []
    for i in range(1, 5):
        sample = {"images": [str(photos / "g" / f"p{i}.png")], "prompt": tasks.SHAPES_PROMPT}
        batch = data.prepare_prompts([sample], tokenizer, image_processor, device="cpu")
        ids = grpo.sample_completions(
            model,
            batch.inputs,
            max_new_tokens=16,
            temperature=0.0,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            suppress_token_ids=data.suppressed_tokens(tokenizer),
        )
        mask, _ = grpo.completion_mask(ids, tokenizer.eos_token_id)
        expected.append(" ".join(data.decode_completions(tokenizer, ids, mask)[0].split()))
    assert summaries == expected
    assert len(set(expected)) > 1, "the photos should not all read the same, or misalignment goes unseen"


def test_pattern_groups_photos_by_the_named_group_of_their_stem(tmp_path):
    photos = tmp_path / "photos"
    for i, name in enumerate(["a_10.png", "a_2.jpg", "b_1.JPG", "sub/c_1.png", "sub/c_3.jpeg"]):
        photo(photos / name, i)
    sp.main(small_args(tmp_path, photos, group_by="pattern", pattern=r"(?P<group>.+)_\d+"))
    out = lines(tmp_path / "out" / "summaries.jsonl")
    assert [(r["group_id"], r["photos"]) for r in out] == [
        ("a", ["../photos/a_2.jpg", "../photos/a_10.png"]),
        ("b", ["../photos/b_1.JPG"]),
        ("c", ["../photos/sub/c_1.png", "../photos/sub/c_3.jpeg"]),
    ]


def test_a_photo_the_pattern_does_not_match_stops_the_run_or_is_skipped_and_counted(tmp_path):
    photos = tmp_path / "photos"
    photo(photos / "a_1.jpg", 0)
    photo(photos / "cover.jpg", 1)
    args = small_args(tmp_path, photos, group_by="pattern", pattern=r"(?P<group>.+)_\d+")
    with pytest.raises(cli.UsageError, match=r"cover\.jpg.*--skip-unmatched"):
        sp.main(args)

    stats = sp.main(
        small_args(tmp_path, photos, group_by="pattern", pattern=args.pattern, skip_unmatched=True)
    )
    assert [r["group_id"] for r in lines(args.output)] == ["a"]
    assert stats["unmatched_photos"] == 1
    report = json.loads((tmp_path / "out" / "summaries.skipped.json").read_text(encoding="utf-8"))
    assert report["unmatched_photos"] == [str(photos / "cover.jpg")]


# --------------------------------------------------------------------------------------------------
# Bad groups: an error naming group and file, or skipped and counted with --skip-bad-groups


def test_a_corrupt_photo_stops_the_run_naming_group_and_file_or_skips_its_group(tmp_path):
    photos = two_groups(tmp_path)
    (photos / "site1" / "a3.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(cli.UsageError, match=r"group 'site1'.*a3\.jpg.*cannot be decoded"):
        sp.main(small_args(tmp_path, photos))
    assert not (tmp_path / "out" / "summaries.jsonl").exists()  # found before any model work

    stats = sp.main(small_args(tmp_path, photos, skip_bad_groups=True))
    assert [r["group_id"] for r in lines(tmp_path / "out" / "summaries.jsonl")] == ["site2"]
    assert stats["skipped"] == {"unreadable photo": 1}
    report = json.loads((tmp_path / "out" / "summaries.skipped.json").read_text(encoding="utf-8"))
    assert [(g["group_id"], g["reason"]) for g in report["groups"]] == [("site1", "unreadable photo")]


def test_a_group_folder_without_photos_stops_the_run_or_is_skipped_and_counted(tmp_path):
    photos = two_groups(tmp_path)
    (photos / "site3").mkdir()
    (photos / "site3" / "readme.txt").write_text("photos to come")
    with pytest.raises(cli.UsageError, match=r"group 'site3'.*site3 holds no photos"):
        sp.main(small_args(tmp_path, photos))
    stats = sp.main(small_args(tmp_path, photos, skip_bad_groups=True))
    assert stats["skipped"] == {"empty group": 1} and stats["written"] == 2


def test_one_group_id_in_two_folders_stops_the_run_naming_both_or_skips_it(tmp_path):
    photos = tmp_path / "photos"
    for i, name in enumerate(["x/a_1.jpg", "y/a_2.jpg", "y/b_1.jpg"]):
        photo(photos / name, i)
    pattern = r"(?P<group>.+)_\d+"
    with pytest.raises(cli.UsageError, match=r"group id 'a' is found in .*x, .*y"):
        sp.main(small_args(tmp_path, photos, group_by="pattern", pattern=pattern))
    stats = sp.main(small_args(tmp_path, photos, group_by="pattern", pattern=pattern, skip_bad_groups=True))
    assert [r["group_id"] for r in lines(tmp_path / "out" / "summaries.jsonl")] == ["b"]
    assert stats["skipped"] == {"duplicate group id": 1}


def test_an_empty_summary_is_never_written_it_stops_the_run_or_skips_its_group(tmp_path, monkeypatch):
    photos = two_groups(tmp_path)
    real = sp.summarise_photos

    def blank_b2(model, tokenizer, image_processor, batch, *rest):  # the model "ends at once" on b2.png
        results = real(model, tokenizer, image_processor, batch, *rest)
        return [("" if p.name == "b2.png" else text, flag) for (_, p), (text, flag) in zip(batch, results)]

    monkeypatch.setattr(sp, "summarise_photos", blank_b2)
    with pytest.raises(cli.UsageError, match=r"group 'site2': the summary of .*b2\.png is empty"):
        sp.main(small_args(tmp_path, photos))
    assert [r["group_id"] for r in lines(tmp_path / "out" / "summaries.jsonl")] == ["site1"]  # kept

    stats = sp.main(small_args(tmp_path, photos, skip_bad_groups=True))
    assert stats["skipped"] == {"empty summary": 1} and stats["already_done"] == 1
    assert [r["group_id"] for r in lines(tmp_path / "out" / "summaries.jsonl")] == ["site1"]


# --------------------------------------------------------------------------------------------------
# Labels


def test_labels_from_csv_or_jsonl_are_joined_by_group_id(tmp_path):
    photos = two_groups(tmp_path)
    csv_file = tmp_path / "labels.csv"
    csv_file.write_text("group_id,label\nsite2,不通过\nsite1, 通过 \n", encoding="utf-8")
    jsonl_file = tmp_path / "labels.jsonl"
    rows = [{"group_id": "site1", "label": "通过"}, {"group_id": "site2", "label": "不通过"}]
    jsonl_file.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")

    for labels in (csv_file, jsonl_file):
        out = tmp_path / labels.suffix[1:] / "summaries.jsonl"
        sp.main(small_args(tmp_path, photos, labels=str(labels), output=str(out)))
        assert [(r["id"], r["label"]) for r in lines(out)] == [("site1", "通过"), ("site2", "不通过")]


def test_a_missing_or_repeated_label_stops_the_run_naming_group_and_file_or_skips_it(tmp_path):
    photos = two_groups(tmp_path)
    labels = tmp_path / "labels.csv"
    labels.write_text("group_id,label\nsite1,通过\n", encoding="utf-8")
    with pytest.raises(cli.UsageError, match=r"group 'site2' has no label in .*labels\.csv"):
        sp.main(small_args(tmp_path, photos, labels=str(labels)))

    labels.write_text("group_id,label\nsite1,通过\nsite2,通过\nsite2,不通过\n", encoding="utf-8")
    with pytest.raises(cli.UsageError, match=r"group 'site2' has several labels: .*labels\.csv:3, .*csv:4"):
        sp.main(small_args(tmp_path, photos, labels=str(labels)))
    stats = sp.main(small_args(tmp_path, photos, labels=str(labels), skip_bad_groups=True))
    assert stats["skipped"] == {"duplicate label": 1}
    assert [r["id"] for r in lines(tmp_path / "out" / "summaries.jsonl")] == ["site1"]


def test_a_label_that_is_not_a_verdict_stops_the_run_naming_file_and_line(tmp_path):
    labels = tmp_path / "labels.jsonl"
    labels.write_text('{"group_id": "site1", "label": "ok"}\n', encoding="utf-8")
    with pytest.raises(cli.UsageError, match=r"labels\.jsonl:1: label 'ok' is not a verdict"):
        sp.main(small_args(tmp_path, two_groups(tmp_path), labels=str(labels)))


# --------------------------------------------------------------------------------------------------
# Resuming


def three_groups(tmp_path: Path) -> Path:
    return tree(tmp_path / "photos", {"g1": ["1.png", "2.png"], "g2": ["1.png"], "g3": ["1.png", "2.png"]})


def test_a_torn_last_line_is_cut_and_only_unfinished_groups_are_summarised_again(tmp_path, capsys):
    photos = three_groups(tmp_path)
    reference = tmp_path / "ref" / "summaries.jsonl"
    sp.main(small_args(tmp_path, photos, batch_size=2, output=str(reference)))
    complete = reference.read_text(encoding="utf-8").splitlines(keepends=True)
    assert len(complete) == 3

    out = tmp_path / "out" / "summaries.jsonl"  # the same depth as ref/, so the same relative paths
    sp.main(small_args(tmp_path, photos, batch_size=2, output=str(out)))
    torn = complete[1].encode()[: len(complete[1].encode()) // 2]  # killed in the middle of line 2
    out.write_bytes(complete[0].encode() + torn)
    capsys.readouterr()

    stats = sp.main(small_args(tmp_path, photos, batch_size=2, output=str(out)))
    assert "dropping a torn last line" in capsys.readouterr().out
    assert out.read_text(encoding="utf-8").splitlines(keepends=True) == complete
    assert stats["already_done"] == 1 and stats["written"] == 2
    assert stats["photos_summarised"] == 3  # g2 and g3 only: g1's two photos were not computed again


def test_a_process_killed_mid_write_resumes_to_the_uninterrupted_file_line_for_line(tmp_path):
    photos = three_groups(tmp_path)
    reference = tmp_path / "ref" / "summaries.jsonl"
    sp.main(small_args(tmp_path, photos, output=str(reference)))
    out = tmp_path / "out" / "summaries.jsonl"
    argv = ["--photos", photos, "--prompt-template", tmp_path / "prompt.txt", "--output", out]
    argv += ["--device", "cpu", "--batch-size", "4", "--max-new-tokens", "16"]
    # The real command, except that half of the second line reaches the disk and the process dies at once.
    die_mid_second_line = f"""
import os, sys, torch
sys.path.insert(0, {str(ROOT)!r})
torch.set_num_threads(1)  # as in the tests, so that the numbers are the same
from scripts import summarize_photos as sp
written = []
def append_line(f, record):
    if written:
        text = sp.json.dumps(record, ensure_ascii=False) + "\\n"
        f.write(text[: len(text) // 2]); f.flush(); os.fsync(f.fileno()); os._exit(9)
    written.append(record)
    real(f, record)
real, sp.outputs.append_line = sp.outputs.append_line, append_line
sp.cli.run(sp.main, sp.tyro.cli(sp.Args))
"""
    result = subprocess.run(
        [sys.executable, "-c", die_mid_second_line, *map(str, argv)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 9, result.stderr[-3000:]
    assert out.read_text(encoding="utf-8").count("\n") == 1  # one whole line, then half of the next

    stats = sp.main(small_args(tmp_path, photos, output=str(out)))  # the same command again
    assert out.read_bytes() == reference.read_bytes()
    assert stats["already_done"] == 1 and stats["written"] == 2


def test_a_rerun_with_another_prompt_or_changed_label_is_refused_until_overwrite(tmp_path):
    photos = two_groups(tmp_path)
    labels = tmp_path / "labels.csv"
    labels.write_text("group_id,label\nsite1,通过\nsite2,通过\n", encoding="utf-8")
    sp.main(small_args(tmp_path, photos, labels=str(labels)))
    with pytest.raises(cli.UsageError, match=r"other settings \(stage_b_prompt\).*--overwrite"):
        sp.main(small_args(tmp_path, photos, labels=str(labels), stage_b_prompt="判断。"))

    labels.write_text("group_id,label\nsite1,通过\nsite2,不通过\n", encoding="utf-8")
    with pytest.raises(cli.UsageError, match=r"group 'site2' was written with label '通过'.*'不通过'"):
        sp.main(small_args(tmp_path, photos, labels=str(labels)))
    sp.main(small_args(tmp_path, photos, labels=str(labels), overwrite=True))
    assert [r["label"] for r in lines(tmp_path / "out" / "summaries.jsonl")] == ["通过", "不通过"]


# --------------------------------------------------------------------------------------------------
# The command line


@pytest.mark.parametrize(
    ("overrides", "flag"),
    [
        (dict(photos=None), "--photos"),
        (dict(photos="no/such/folder"), "--photos"),
        (dict(prompt_template="no/such/prompt.txt"), "--prompt-template"),
        (dict(group_by="pattern"), "--pattern"),
        (dict(group_by="pattern", pattern=r".+_\d+"), "--pattern"),  # no named group
        (dict(group_by="pattern", pattern="(?P<group>"), "--pattern"),
        (dict(pattern=r"(?P<group>.+)_\d+"), "--pattern"),  # given with --group-by folder
        (dict(labels="labels.txt"), "--labels"),
        (dict(batch_size=0), "--batch-size"),
        (dict(temperature=-1.0), "--temperature"),
        (dict(stage_b_prompt=" "), "--stage-b-prompt"),
    ],
)
def test_a_bad_flag_is_a_usage_error_naming_it_before_any_work(tmp_path, overrides, flag):
    photos = tmp_path / "photos"
    photos.mkdir()
    (tmp_path / "labels.txt").write_text("x")
    overrides = {k: str(tmp_path / v) if k == "labels" else v for k, v in overrides.items()}
    with pytest.raises(cli.UsageError, match=f"^{flag}:"):
        sp.main(dataclasses.replace(small_args(tmp_path, photos), **overrides))


def run_script(*argv) -> subprocess.CompletedProcess:
    command = [sys.executable, "scripts/summarize_photos.py", *map(str, argv)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize("mistake", ["bad pattern", "corrupt photo"])
def test_the_command_exits_2_with_one_error_line_and_no_traceback(tmp_path, mistake):
    photos = two_groups(tmp_path)
    (tmp_path / "prompt.txt").write_text("describe the photo")
    argv = [
        "--photos",
        photos,
        "--prompt-template",
        tmp_path / "prompt.txt",
        "--output",
        tmp_path / "o.jsonl",
    ]
    if mistake == "bad pattern":
        argv += ["--group-by", "pattern", "--pattern", r".+_\d+"]
        named = ["--pattern", "(?P<group>"]
    else:
        (photos / "site2" / "b4.png").write_bytes(b"")
        named = ["group 'site2'", "b4.png", "--skip-bad-groups"]
    result = run_script(*argv)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and all(part in errors[0] for part in named), result.stderr[-3000:]
    assert "Traceback" not in output


# --------------------------------------------------------------------------------------------------
# Stage B on stage A's output


def test_stage_b_trains_on_stage_a_output_without_conversion(tmp_path):
    photos = two_groups(tmp_path)
    labels = tmp_path / "labels.csv"
    labels.write_text("group_id,label\nsite1,通过\nsite2,不通过\n", encoding="utf-8")
    out = tmp_path / "out" / "summaries.jsonl"
    sp.main(small_args(tmp_path, photos, labels=str(labels)))

    summary = trainer.main(
        train_args(
            data=(str(out),),
            prompt_template=str(ROOT / "assets" / "summaries_template.txt"),
            reward=("label", "format"),
            steps=2,
            batch_size=2,
            group_size=2,
            eval_size=0,
            max_new_tokens=8,
            output_dir=str(tmp_path / "stage_b"),
            device="cpu",
            seed=0,
        )
    )
    assert summary["steps"] == 2
    assert (tmp_path / "stage_b" / "adapter" / "adapter_config.json").is_file()
    rollouts = lines(tmp_path / "stage_b" / "rollouts.jsonl")
    assert {r["sample_id"] for r in rollouts} <= {"site1", "site2"}  # the group ids name the samples
