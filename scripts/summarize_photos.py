"""Stage A of the two-stage inspection pipeline: a VLM writes one text summary per photo, one JSONL line per
installation, which stage B (trainer.py, evaluate.py) reads as it is.

    python scripts/summarize_photos.py --photos shots/ --prompt-template prompts/bolts.txt \\
        --labels labels.csv --output runs/stage_a/bolts.jsonl            # shots/<group id>/*.jpg
    python scripts/summarize_photos.py --photos shots/ --group-by pattern --pattern '(?P<group>.+)_\\d+' \\
        --prompt-template prompts/bolts.txt --output runs/stage_a/bolts.jsonl   # shots/**/site3_1.jpg ...
    tail -f runs/stage_a/bolts.jsonl                        # one line per group, as soon as it is done
    python -m grpo_vlm --data runs/stage_a/bolts.jsonl --prompt-template assets/summaries_template.txt \\
        --reward label format                               # stage B: the verdict from the summaries

Groups. `--group-by folder`: each immediate sub-folder of --photos is one installation, its name the group
id, its photos the ones directly inside it. `--group-by pattern`: every photo under --photos, at any depth,
whose file stem matches --pattern in full; the regex's named group `group` is the id, and one id found in two
folders is a duplicate, not one group. Photos are .jpg, .jpeg and .png in any letter case; every other file,
and hidden ones (`.x`, e.g. macOS's `._photo.jpg`, which are not images), is ignored and counted. A photo the
grouping cannot place (a stem the pattern does not match, a photo outside the group folders) is an error, or
skipped and counted with --skip-unmatched. Photos within a group, and the groups, are in natural order:
img2 before img10, letter case ignored.

Output, one line per group (the keys in this order; `label` only with --labels):

    {"group_id": "site3", "id": "site3", "label": "不通过", "prompt": "<--stage-b-prompt>",
     "summaries": ["...", "..."], "photos": ["../../shots/site3/img1.jpg", ...], "truncated": [false, false]}

- `summaries[i]` is the model's answer to the --prompt-template text about `photos[i]`, asked with that photo
  alone in the prompt (a summary never mixes two photos); exactly one per photo, in order, never empty.
  Whitespace runs, newlines included, become one space: stage B renders each summary as ONE numbered line
  (`图片_1: ...`), and a newline inside it would start a line that belongs to no photo.
- `truncated[i]`: the summary hit --max-new-tokens before EOS (kept, flagged, counted at the end).
- `photos`, not `images`: data.py refuses a sample with both `images` and `summaries`. Paths are relative to
  the output file's folder, as data.py resolves paths of a JSONL file.
- `id` and `prompt` are what stage B needs besides `summaries` and `label`: `id` names the sample in
  evaluate.py's output and in rollouts.jsonl; `prompt` fills `{prompt}` of stage B's --prompt-template.

Bad groups: an unreadable photo, a group folder without photos, a group id found twice, a label missing or
given twice (with --labels) and an empty summary stop the run with one line naming the group and the file
(status 2); with --skip-bad-groups the group is printed, left out of the output, counted in the last line and
listed in `<output stem>.skipped.json`; a run that leaves no group in the output, or skips more than half of
them, still ends with status 2 (the count and the first reasons). NOTE: an empty summary (the model ends at
once) is not retried: a greedy retry gives the same, a sampled one would make the line depend on how many
tries ran; it is never written as "" either (stage B would read a photo without a description). Change the
prompt or skip.

Batches: --batch-size photos per forward, whole groups packed together (a group larger than a batch gets
batches of its own), so the batches are the same on every run: a resumed run computes exactly what an
uninterrupted one computes, and a batch whose groups are all written is not run again (only a kill between
two lines of one batch makes its finished groups be computed again, and not written twice).

Resuming: each group's line is written with its newline, flushed and fsynced when the group is done. On
start a torn last line (a kill mid-write) is cut off the file with a message, and groups already written are
skipped: after checking that their photos and label are still the ones the line holds.
`<output stem>.settings.json` records what decides the summaries; a rerun with other settings into the same
file is refused (pass --overwrite or another --output), and so is an existing output without that settings
file (a file of yours, another script's output): it is left as it is unless --overwrite replaces it.
Ctrl-C or SIGTERM stops at once (status 130): every finished group is in the file, and the same command
continues.

Outputs (scripts/outputs.py): one process per --output (a second one is refused naming the holder; the lock
is `.<output name>.lock` beside it); an output inside --photos or over another input is refused; an output
that cannot be written (read-only, no space, no permission) is one line `error: cannot write ...`, status 74;
an output that is a symbolic link is refused (--overwrite replaces the link, never its target), one that is
a FIFO too. A photo that is not a regular file (a FIFO named `b.jpg`) is an unreadable photo, never opened.
"""

from __future__ import annotations

import collections
import csv
import io
import json
import math
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

if __name__ == "__main__":  # NOTE: a Ctrl-C while torch imports (~2 s) exits 130, with no traceback
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(130))
import torch
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data
import grpo
import model_io
import rewards
from grpo_vlm import adapters, cli, dataset, distributed, files, model_files, sampling_config, speedups
from scripts import outputs

DEFAULT_STAGE_B_PROMPT = (
    "根据以下各张照片的文字摘要，判断该安装是否合格。"
    "第一行只回答 通过 或 不通过，第二行以 理由: 开头写出原因。"
)


@dataclass
class Args:
    # --- photos ---
    photos: str | None = None
    """Folder of photos (.jpg, .jpeg, .png, any letter case). Required."""
    group_by: Literal["folder", "pattern"] = "folder"
    """folder: each immediate sub-folder is one group (id: its name; photos: the ones directly in it).
    pattern: every photo under --photos, at any depth, grouped by --pattern."""
    pattern: str | None = None
    """With --group-by pattern: a regex with a named group `group`, matched against the whole file stem;
    '(?P<group>.+)_\\d+' puts site3_1.jpg and site3_2.png in group site3."""
    skip_unmatched: bool = False
    """Skip (and count) photos the grouping cannot place, instead of stopping: a stem --pattern does not
    match, a photo outside the group sub-folders."""
    labels: str | None = None
    """CSV with a header and columns group_id,label, or JSONL lines {"group_id": ..., "label": ...}: each
    group's verdict (通过 / 不通过 / pass / fail), written as the line's `label`. Every group needs one."""
    skip_bad_groups: bool = False
    """Skip a bad group (unreadable photo, no photos, id found twice, label missing or given twice, empty
    summary): printed, counted, listed in <output stem>.skipped.json. Default: stop, naming group and file."""

    # --- model ---
    model: str = model_io.DEFAULT_MODEL
    """Local folder or hub id of the VLM. The default is the tiny Qwen2.5-VL shipped in assets/."""
    adapter: str | None = None
    """A PEFT-format LoRA adapter folder (runs/grpo/adapter, or the reference's). None: the base model."""
    device: str = "auto"
    """'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1', ..."""
    dtype: str = "auto"
    """'auto' (bf16 on CUDA, fp32 on CPU), 'float32', 'bfloat16' or 'float16'."""

    # --- summaries ---
    prompt_template: str | None = None
    """Text file holding the question asked about every photo, used verbatim (one file per mission; no
    placeholders, unlike trainer.py's --prompt-template). Required."""
    batch_size: int = 16
    """Photos per forward (one photo per prompt)."""
    max_new_tokens: int = 128
    """Longest summary in tokens; one that reaches it without EOS is kept and flagged `truncated`."""
    temperature: float = 0.0
    """0: greedy. > 0: sampled, each batch seeded by --seed and its index (a resumed run draws the same)."""
    seed: int = 0
    """Seeds sampling when --temperature > 0."""

    # --- output ---
    stage_b_prompt: str = DEFAULT_STAGE_B_PROMPT
    """Written as every line's `prompt`: the instruction stage B's template puts before the summaries."""
    output: str = "runs/stage_a/summaries.jsonl"
    """Output JSONL, one line per group; resumed when it exists."""
    overwrite: bool = False
    """Start the output afresh instead of resuming it."""


PHOTO_SUFFIXES = (".jpg", ".jpeg", ".png")
PRODUCER = "summarize_photos.py"  # named in the settings file beside the output: it continues only its own


@dataclass
class Group:
    """One installation: its id, its photos in natural order, the folder(s) holding them, its label."""

    id: str
    photos: list[Path]
    folders: list[Path]
    label: str | None = None


# --------------------------------------------------------------------------------------------------
# Finding the photos and their groups


def natural_key(name: str) -> tuple:
    """Sort key that puts img2 before img10 and ignores letter case; the name itself breaks ties."""
    parts = re.split(r"([0-9]+)", name)  # text, number, text, ...: the same type at the same place
    return tuple(int(p) if i % 2 else p.casefold() for i, p in enumerate(parts)), name


def walk_files(root: Path) -> Iterator[Path]:
    """Every file under `root`; an unreadable folder raises (os.walk would skip it silently)."""

    def fail(error: OSError) -> None:
        raise error

    for folder, _, names in os.walk(root, onerror=fail):
        for name in names:
            yield Path(folder) / name


def is_photo(path: Path, root: Path) -> bool:
    hidden = any(part.startswith(".") for part in path.relative_to(root).parts)
    return path.suffix.lower() in PHOTO_SUFFIXES and not hidden


def find_photos(root: Path, group_by: str, pattern: re.Pattern | None) -> tuple[dict, list[tuple], int]:
    """(group id -> {folder: photos}, unmatched (photo, why) pairs, count of other files ignored)."""
    found: dict[str, dict[Path, list[Path]]] = collections.defaultdict(dict)
    if group_by == "folder":  # every sub-folder is a group, even one without photos (reported as empty)
        for sub in root.iterdir():
            if sub.is_dir() and not sub.name.startswith("."):
                found[sub.name][sub] = []
    unmatched, ignored = [], 0
    for path in walk_files(root):
        if not is_photo(path, root):
            ignored += 1
            continue
        if group_by == "folder":
            parts = path.relative_to(root).parts
            group_id = parts[0] if len(parts) == 2 else None
            why = (
                "is not directly inside a sub-folder of --photos (--group-by folder: one sub-folder a group)"
            )
        else:
            match = pattern.fullmatch(path.stem)
            group_id = match.group("group") if match else None  # NOTE: an empty id does not match either
            why = f"has a stem {path.stem!r} that --pattern {pattern.pattern!r} does not match in full"
        if not group_id:
            unmatched.append((path, why))
            continue
        found[group_id].setdefault(path.parent, []).append(path)
    return found, unmatched, ignored


def reject(skipped: list[dict], skip: bool, group_id: str, reason: str, message: str) -> None:
    """A bad group: an error naming it, or with --skip-bad-groups printed and recorded (never silent)."""
    if not skip:
        raise cli.UsageError(f"{message} (or pass --skip-bad-groups to skip such groups)")
    print(f"skipping: {message}", flush=True)
    skipped.append({"group_id": group_id, "reason": reason, "message": message})


def make_groups(found: dict, skipped: list[dict], skip: bool) -> list[Group]:
    """Groups in natural order; an id found in two folders or a group without photos is rejected."""
    groups = []
    for group_id in sorted(found, key=natural_key):
        folders = sorted(found[group_id])
        if len(folders) > 1:
            where = ", ".join(str(f) for f in folders)
            reject(
                skipped, skip, group_id, "duplicate group id", f"group id {group_id!r} is found in {where}"
            )
            continue
        photos = sorted(found[group_id][folders[0]], key=lambda p: natural_key(p.name))
        if not photos:
            message = f"group {group_id!r}: folder {folders[0]} holds no photos ({', '.join(PHOTO_SUFFIXES)})"
            reject(skipped, skip, group_id, "empty group", message)
            continue
        groups.append(Group(group_id, photos, folders))
    return groups


def scan(args: Args, skipped: list[dict]) -> tuple[list[Group], list[Path], int]:
    """(groups, unmatched photos skipped, other files ignored) of --photos."""
    root = Path(args.photos)
    pattern = re.compile(args.pattern) if args.pattern else None
    with cli.user_errors("--photos: "):
        found, unmatched, ignored = find_photos(root, args.group_by, pattern)
    if unmatched and not args.skip_unmatched:
        photo, why = unmatched[0]
        more = f" (and {len(unmatched) - 1} more)" if len(unmatched) > 1 else ""
        raise cli.UsageError(f"{photo} {why}{more}; move or rename it, or pass --skip-unmatched")
    for photo, why in unmatched:
        print(f"skipping photo {photo}: it {why}")
    groups = make_groups(found, skipped, args.skip_bad_groups)
    cli.check(bool(groups) or bool(skipped), "--photos", f"{root} holds no photos to group")
    return groups, [photo for photo, _ in unmatched], ignored


# --------------------------------------------------------------------------------------------------
# Labels


def is_verdict(label: str) -> bool:
    """Whether stage B's `label` reward accepts it (it raises on anything but a verdict word)."""
    try:
        rewards.label_reward("", {"label": label})
    except ValueError:
        return False
    return True


def read_text(path: Path) -> str:
    """The file as text (utf-8-sig: Excel writes a byte-order mark); a byte not UTF-8 names its line."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 (byte 0x{raw[e.start]:02x})") from e


def label_rows(path: Path) -> Iterator[tuple[str, object, object]]:
    """('file:line', group_id, label) of every row of a CSV (with a header) or JSONL labels file."""
    text = read_text(path)
    if path.suffix.lower() == ".csv":
        reader = csv.DictReader(io.StringIO(text, newline=""))
        try:
            columns = reader.fieldnames or []
            if not {"group_id", "label"} <= set(columns):
                raise ValueError(f"{path}:1: needs a header with columns group_id,label; found {columns}")
            for row in reader:
                yield f"{path}:{reader.line_num}", row["group_id"], row["label"]
        except csv.Error as e:  # e.g. a field over csv's limit of 131,072 characters
            raise ValueError(f"{path}:{reader.line_num}: not a CSV row ({e})") from e
        return
    for lineno, line in enumerate(io.StringIO(text, newline=""), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: invalid JSON at column {e.colno}: {e.msg}") from e
        except RecursionError as e:  # json's parser recurses once per '[' or '{'
            raise ValueError(f"{path}:{lineno}: JSON nested too deeply") from e
        except ValueError as e:  # an integer of more than 4,300 digits
            raise ValueError(f"{path}:{lineno}: {e}") from e
        if not isinstance(row, dict):
            raise ValueError(f'{path}:{lineno}: a line must be a JSON object {{"group_id", "label"}}')  # noqa: TRY004 (a data error, reported as one)
        yield f"{path}:{lineno}", row.get("group_id"), row.get("label")


def read_labels(path: Path) -> dict[str, list[tuple[str, str]]]:
    """group id -> [(label, 'file:line'), ...]; a malformed row raises ValueError naming file:line."""
    labels = collections.defaultdict(list)
    for where, group_id, label in label_rows(path):
        # CSV cells are strings; a JSON id may be a number (17 names folder "17"), never a bool.
        if isinstance(group_id, int) and not isinstance(group_id, bool):
            group_id = str(group_id)
        if not (isinstance(group_id, str) and group_id.strip()):
            raise ValueError(f"{where}: group_id must be a non-empty string, got {group_id!r}")
        if not (isinstance(label, str) and is_verdict(label.strip())):
            raise ValueError(f"{where}: label {label!r} is not a verdict (通过, 不通过, pass or fail)")
        labels[group_id.strip()].append((label.strip(), where))
    return labels


def join_labels(groups: list[Group], labels: dict, path: Path, skipped: list[dict]) -> None:
    """Each group's label, or None when it has none or several (rejected later, unless already written)."""
    for group in groups:
        entries = labels.get(group.id, [])
        group.label = entries[0][0] if len(entries) == 1 else None
    unused = set(labels) - {g.id for g in groups} - {s["group_id"] for s in skipped}
    unused = sorted(unused, key=natural_key)
    if unused:  # often a naming mismatch between the labels file and the folder: say so
        shown = ", ".join(repr(u) for u in unused[:5]) + (", ..." if len(unused) > 5 else "")
        print(f"warning: {path}: {len(unused)} labelled group(s) are not among the groups: {shown}")


def reject_unlabelled(
    groups: list[Group], labels: dict, path: Path, skipped: list[dict], skip: bool
) -> list[Group]:
    kept = []
    for group in groups:
        entries = labels.get(group.id, [])
        if not entries:
            reject(skipped, skip, group.id, "missing label", f"group {group.id!r} has no label in {path}")
        elif len(entries) > 1:
            where = ", ".join(w for _, w in entries)
            reject(
                skipped, skip, group.id, "duplicate label", f"group {group.id!r} has several labels: {where}"
            )
        else:
            kept.append(group)
    return kept


# --------------------------------------------------------------------------------------------------
# The output file: resuming, settings


def settings_of(args: Args, prompt: str) -> dict:
    """What decides the lines: a rerun with other values would mix two runs in one file."""
    sampled = args.temperature > 0
    return {
        "photos": str(Path(args.photos).resolve()),
        "group_by": args.group_by,
        "pattern": args.pattern,
        "with_labels": args.labels is not None,  # the labels themselves are checked line by line
        "model": args.model,
        "adapter": str(Path(args.adapter).resolve()) if args.adapter else None,
        "prompt": prompt,
        "stage_b_prompt": args.stage_b_prompt,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "seed": args.seed if sampled else None,
        "batch_size": args.batch_size if sampled else None,  # sampled draws are seeded per batch
        "dtype": args.dtype,
    }


def photo_paths(group: Group, out_dir: Path) -> list[str]:
    """The photos relative to the output's folder (how data.py resolves the paths of a JSONL file)."""
    return [os.path.relpath(p.resolve(), out_dir) for p in group.photos]


def check_done(done: dict[str, dict], groups: list[Group], path: Path) -> None:
    """A written group must still have the photos and label its line holds, else the file mixes two states."""
    out_dir = path.parent.resolve()
    for group in groups:
        record = done.get(group.id)
        if record is None:
            continue
        if record.get("photos") != photo_paths(group, out_dir):
            raise cli.UsageError(
                f"{path}: group {group.id!r} was written from other photos than {group.folders[0]} holds "
                "now; pass --overwrite or choose another --output"
            )
        if record.get("label") != group.label:
            raise cli.UsageError(
                f"{path}: group {group.id!r} was written with label {record.get('label')!r}, the labels now "
                f"give {group.label!r}; pass --overwrite or choose another --output"
            )
    stale = len(done.keys() - {g.id for g in groups})
    if stale:
        print(f"warning: {path} holds {stale} group(s) not among this run's groups (removed, or now bad)")


# --------------------------------------------------------------------------------------------------
# Summaries


def photo_size(path: Path, group_id: str) -> tuple[int, int]:
    """(width, height) of a photo, decoded in full; a ValueError names the group and the file."""
    where = {"_where": f"group {group_id!r}"}  # load_image's message names the file, `_where` the group
    try:
        files.regular_file(path)  # NOTE: a FIFO named like a photo would block the read: refused unread
    except ValueError as e:
        raise ValueError(f"{data.location(where)}: {e}") from None
    return data.load_image(str(path), where).size


def check_photos(groups: list[Group], skipped: list[dict], skip: bool) -> tuple[list[Group], list[tuple]]:
    """(groups whose every photo decodes, the (width, height) of their photos); a photo that does not decode
    rejects its group. One decode per photo, before the model loads: a bad file costs no model time."""
    kept, sizes = [], []
    for group in groups:
        try:
            group_sizes = [photo_size(p, group.id) for p in group.photos]
        except ValueError as e:
            reject(skipped, skip, group.id, "unreadable photo", str(e))
            continue
        kept.append(group)
        sizes += group_sizes
    return kept, sizes


def describe_resizes(sizes: list[tuple[int, int]], image_processor) -> str | None:
    """dataset.describe_resizes of the photos the image processor will shrink to its pixel budget."""
    budget = dataset.image_pixel_budget(image_processor)
    oversized = [(w, h) for w, h in sizes if budget is not None and w * h > budget]
    largest = max(oversized, key=lambda size: size[0] * size[1], default=None)
    return dataset.describe_resizes(dataset.ResizeReport(count=len(oversized), largest=largest), budget)


def load_model(args: Args, device: torch.device):
    """(model, tokenizer, image_processor), with --adapter loaded (load_adapter injects LoRA itself)."""
    with cli.user_errors("--dtype: "):
        dtype = model_files.resolve_dtype(args.dtype, device)
    with cli.user_errors("--model: "):
        model, tokenizer, image_processor = model_files.load_model(args.model, device=device, dtype=dtype)
    cli.check(
        image_processor is not None, "--model", f"{args.model} is a text-only model; stage A needs a VLM"
    )
    if args.adapter:
        with cli.user_errors(f"--adapter {args.adapter}: "):  # e.g. made for another model (keys, shapes)
            adapters.load_adapter(model, args.adapter)
    return model.eval(), tokenizer, image_processor


@torch.no_grad()
def summarise_photos(
    model, tokenizer, image_processor, photos: list[tuple[Group, Path]], prompt: str, args: Args, device
) -> list[tuple[str, bool]]:
    """(summary on one line, truncated) of each photo, asked about with that photo alone in its prompt."""
    samples = [{"images": [str(p)], "prompt": prompt, "_where": f"group {g.id!r}"} for g, p in photos]
    batch = dataset.prepare_prompts(samples, tokenizer, image_processor, device=device)
    options = sampling_config.sampler_options(
        tokenizer, model.generation_config, max_new_tokens=args.max_new_tokens, temperature=args.temperature
    )
    ids, _ = speedups.sample_shared_prefill(model, batch.inputs, group_size=1, **options)  # (photos, T)
    ends = options["eos_token_id"]
    mask, truncated = grpo.completion_mask(ids, ends)  # (photos, T), (photos,)
    texts = data.decode_completions(tokenizer, ids, mask, ends)
    # Stage B puts each summary on one numbered line: a newline inside it would start a line of no photo.
    return [(" ".join(text.split()), flag) for text, flag in zip(texts, truncated.tolist())]


def plan_batches(sizes: list[int], batch_size: int) -> list[list[tuple[int, int, int]]]:
    """Batches of (group index, first photo, end photo) pieces: whole groups packed up to batch_size photos,
    a group larger than that in batches of its own. A function of the group sizes only, so a resumed run
    cuts the same batches (same numbers) and a batch of finished groups is not run again."""
    batches, current, filled = [], [], 0
    for g, n in enumerate(sizes):
        if filled + n > batch_size and current:
            batches.append(current)
            current, filled = [], 0
        if n > batch_size:
            batches += [[(g, start, min(start + batch_size, n))] for start in range(0, n, batch_size)]
            continue
        current.append((g, 0, n))
        filled += n
    return batches + ([current] if current else [])


def group_record(group: Group, results: list[tuple[str, bool]], stage_b_prompt: str, out_dir: Path) -> dict:
    """The output line of a group: one summary per photo, in the photos' order."""
    assert len(results) == len(group.photos), "a summary was lost or duplicated (a bug)"
    record = {"group_id": group.id, "id": group.id}
    if group.label is not None:
        record["label"] = group.label
    record["prompt"] = stage_b_prompt
    record["summaries"] = [text for text, _ in results]
    record["photos"] = photo_paths(group, out_dir)
    record["truncated"] = [flag for _, flag in results]
    return record


def finish_group(f, group: Group, results: list[tuple[str, bool]], args: Args, skipped: list[dict]) -> bool:
    """Append the group's line, or reject the group if a summary is empty; whether a line was written."""
    empty = [p for p, (text, _) in zip(group.photos, results) if not text]
    if empty:
        message = (
            f"group {group.id!r}: the summary of {empty[0]} is empty (the model wrote only EOS or "
            "whitespace); try another --prompt-template"
        )
        reject(skipped, args.skip_bad_groups, group.id, "empty summary", message)
        return False
    record = group_record(group, results, args.stage_b_prompt, Path(args.output).parent.resolve())
    with cli.writing(args.output):
        outputs.append_line(f, record)
    return True


def summarise_groups(model, tokenizer, image_processor, groups, done, prompt, args, device, skipped) -> dict:
    """Summarise the groups not in `done`, appending one fsynced line per group as soon as it is complete."""
    batches = plan_batches([len(g.photos) for g in groups], args.batch_size)
    todo = [i for i, b in enumerate(batches) if any(groups[g].id not in done for g, _, _ in b)]
    stats = {"written": 0, "photos_summarised": 0, "truncated": 0}
    pending: dict[int, list[tuple[str, bool]]] = {}  # group index -> results of its photos so far
    with cli.writing(args.output):
        f = Path(args.output).open("a", encoding="utf-8")  # noqa: SIM115 (closed by the `with f` below)
    with f:
        for n, index in enumerate(todo, start=1):
            torch.manual_seed(args.seed * 1_000_000 + index)  # the draws depend on --seed and the batch only
            pieces = batches[index]
            photos = [(groups[g], groups[g].photos[k]) for g, start, end in pieces for k in range(start, end)]
            results = iter(summarise_photos(model, tokenizer, image_processor, photos, prompt, args, device))
            stats["photos_summarised"] += len(photos)
            for g, start, end in pieces:
                pending.setdefault(g, []).extend(next(results) for _ in range(start, end))
                if end < len(groups[g].photos):
                    continue  # the group goes on in the next batch
                group, group_results = groups[g], pending.pop(g)
                # NOTE: a written group is in a batch run again only if a kill fell between two of its lines.
                if group.id not in done and finish_group(f, group, group_results, args, skipped):
                    stats["written"] += 1
                    stats["truncated"] += sum(flag for _, flag in group_results)
            print(f"  batch {n}/{len(todo)}", flush=True)
    return stats


# --------------------------------------------------------------------------------------------------
# Main


def check_args(args: Args) -> None:
    """Every flag's range and every file it names, before anything is read or loaded (cli.UsageError)."""
    cli.check(args.photos is not None, "--photos", "is required: the folder of photos to summarise")
    cli.check(Path(args.photos).is_dir(), "--photos", f"{args.photos} is not a folder")
    cli.check(
        args.prompt_template is not None,
        "--prompt-template",
        "is required: a text file with the question asked about every photo",
    )
    cli.check(
        Path(args.prompt_template).is_file(), "--prompt-template", f"{args.prompt_template} is not a file"
    )
    if args.group_by == "pattern":
        cli.check(args.pattern is not None, "--pattern", "is required with --group-by pattern")
        try:
            pattern = re.compile(args.pattern)
        except re.error as e:
            raise cli.UsageError(f"--pattern: {args.pattern!r} is not a regular expression ({e})") from None
        cli.check(
            "group" in pattern.groupindex, "--pattern", "needs a named group (?P<group>...) capturing the id"
        )
    else:
        cli.check(args.pattern is None, "--pattern", "is only used with --group-by pattern")
    if args.labels is not None:
        cli.check(Path(args.labels).is_file(), "--labels", f"{args.labels} is not a file")
        suffix = Path(args.labels).suffix.lower()
        cli.check(suffix in (".csv", ".jsonl"), "--labels", f"{args.labels}: expected a .csv or .jsonl file")
    if args.adapter is not None:
        config = Path(args.adapter) / model_io.ADAPTER_CONFIG
        cli.check(
            config.is_file(),
            "--adapter",
            f"{config} does not exist: give a folder written by trainer.py",
        )
    for flag, value in (("--batch-size", args.batch_size), ("--max-new-tokens", args.max_new_tokens)):
        cli.check(value >= 1, flag, f"must be >= 1, got {value}")
    ok = math.isfinite(args.temperature) and args.temperature >= 0
    cli.check(ok, "--temperature", f"must be >= 0 (0: greedy), got {args.temperature}")
    cli.check(bool(args.stage_b_prompt.strip()), "--stage-b-prompt", "must not be empty")
    cli.check(not Path(args.output).is_dir(), "--output", f"{args.output} is a folder; give a .jsonl file")
    out = Path(args.output)
    written = [out, out.with_suffix(".settings.json"), out.with_suffix(".skipped.json")]
    read = {"--photos": [args.photos], "--prompt-template": [args.prompt_template], "--labels": [args.labels]}
    read.update({"--adapter": [args.adapter], "--model": [args.model] if Path(args.model).is_dir() else []})
    outputs.refuse_overwriting_inputs({"--output": written}, read)
    outputs.check_own_output(out, "--output", args.overwrite, PRODUCER)  # a user's file is never continued


def read_prompt(path: str) -> str:
    with cli.user_errors("--prompt-template: "):
        prompt = Path(path).read_text(encoding="utf-8-sig").strip()
    cli.check(bool(prompt), "--prompt-template", f"{path} is empty")
    return prompt


def summarise(args: Args) -> dict:
    start = time.time()
    with cli.user_errors():
        device = distributed.resolve_device(args.device)
    prompt = read_prompt(args.prompt_template)
    skipped: list[dict] = []
    groups, unmatched, ignored = scan(args, skipped)
    labels = {}
    if args.labels:
        with cli.user_errors():
            labels = read_labels(Path(args.labels))
        join_labels(groups, labels, Path(args.labels), skipped)
    path = Path(args.output)
    with cli.user_errors():
        with cli.writing(path.with_suffix(".settings.json")):
            settings = settings_of(args, prompt)
            outputs.check_settings(path, settings, args.overwrite, PRODUCER, companions=(".skipped.json",))
        done = {r["group_id"]: r for r in outputs.read_resumable(path, "group_id", PRODUCER)}
    check_done(done, groups, path)
    todo = [g for g in groups if g.id not in done]
    if args.labels:
        todo = reject_unlabelled(todo, labels, Path(args.labels), skipped, args.skip_bad_groups)
    todo, sizes = check_photos(todo, skipped, args.skip_bad_groups)
    groups = [g for g in groups if g.id in done] + todo
    groups.sort(key=lambda g: natural_key(g.id))
    print(f"{path}: {len(groups) - len(todo)} of {len(groups)} groups already done")
    stats = {"written": 0, "photos_summarised": 0, "truncated": 0}
    if todo:  # a finished run's rerun loads no model
        model, tokenizer, image_processor = load_model(args, device)
        message = describe_resizes(sizes, image_processor)
        if message:
            print(message)
        stats = summarise_groups(
            model, tokenizer, image_processor, groups, done, prompt, args, device, skipped
        )
    report = {"groups": skipped, "unmatched_photos": [str(p) for p in unmatched]}
    with cli.writing(path.with_suffix(".skipped.json")):
        outputs.write_json_atomic(path.with_suffix(".skipped.json"), report)
    stats.update(
        already_done=len(groups) - len(todo),
        skipped=dict(collections.Counter(s["reason"] for s in skipped)),
        unmatched_photos=len(unmatched),
        other_files=ignored,
        seconds=time.time() - start,
    )
    print(summary_line(path, stats))
    check_mostly_done(stats, skipped, path)
    return stats


def check_mostly_done(stats: dict, skipped: list[dict], path: Path) -> None:
    """A run that leaves no group in the output, or skips more than half of its groups, is a failure, not
    a success: cli.UsageError (status 2) with the count and the first reasons (the output keeps its lines)."""
    kept = stats["written"] + stats["already_done"]
    if kept and len(skipped) <= (kept + len(skipped)) / 2:
        return
    first = "; ".join(s["message"] for s in skipped[:2])
    raise cli.UsageError(
        f"--photos: {len(skipped)} of {kept + len(skipped)} groups skipped, {kept} in {path} (first: "
        f"{first}); every skipped group is listed in {path.with_suffix('.skipped.json')}"
    )


def summary_line(path: Path, stats: dict) -> str:
    reasons = ", ".join(f"{n} {reason}" for reason, n in sorted(stats["skipped"].items()))
    skipped = sum(stats["skipped"].values())
    return (
        f"{path}: {stats['written']} groups written ({stats['already_done']} already done), {skipped} skipped"
        + (f" ({reasons})" if reasons else "")
        + f", {stats['photos_summarised']} photos summarised ({stats['truncated']} truncated), "
        f"{stats['unmatched_photos']} unmatched photos skipped, {stats['other_files']} other files ignored, "
        f"{stats['seconds']:.1f} s"
    )


def main(args: Args) -> dict:
    """Summarise every group of --photos into --output; returns the counts of the last line."""
    check_args(args)
    # Ctrl-C / SIGTERM stop at once: every finished group is already on disk
    with cli.signals(), outputs.claimed({"--output": [Path(args.output)]}):
        try:
            return summarise(args)
        except cli.Stopped:
            raise cli.Stopped(
                f"stopped; every finished group is in {args.output}: run the same command to continue"
            ) from None


if __name__ == "__main__":
    cli.run(main, tyro.cli(Args))
