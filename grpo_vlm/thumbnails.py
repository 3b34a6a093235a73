"""Each logged sample's images kept in the run folder's thumbs/, so that a report shows every logged rollout
beside the pictures the model saw: a small thumbnail and the image at the size the model saw it, as JPEGs.

    thumbs/<key>.jpg       longest side <= THUMB_SIDE (never upscaled), JPEG quality 85
    thumbs/<key>-seen.jpg  at the image processor's resized size (smart_resize: multiples of patch_size *
                           merge_size, 28 for Qwen2.5-VL), resampled with its filter; longest side capped at
                           SEEN_SIDE, so that a huge pixel budget does not fill the disk; JPEG quality 90

A record's "thumbs" entry per image: {"thumb", "seen" (None past SEEN_BYTES), "size": [w, h] original,
"seen_size": [w', h']}, or {"error": "<one line>"} for an image that cannot be kept (a file moved or
unreadable since the run checked it): the record is still written, the error is its visible outcome. A tool
call's returned crop gets "thumb" (or "thumb_error") in its record's "images" entry.

Choices:
- `<key>`: the first 16 hex digits of SHA-256 over f"{w}x{h}" and the decoded RGB pixels, so the same picture
  is kept once whatever its path or object; an existing file is never rewritten.
- Every rank makes the JPEGs of its own rows, in memory; the writing rank writes them all (`write`,
  atomically), after `distributed.gather_to_writer` brought them: no file is written by a rank that may not
  see the run folder, and none before the folder's run is set up (the step-0 evaluation runs before that).
  `Kept` remembers, per rank, the files handed on already: a repeated image is hashed but never encoded or
  sent again; a file, by (path, modification time, size), is not even decoded again.
- Off the step's critical path: `keep_aside` runs `keep` on one thread per rank (`Kept.thread`), started
  as soon as a step's logged rows are known (after its rollout), while its log-prob passes and update run;
  the writer takes the result before it writes the lines that name the files. One thread, calls in the
  order made: `Kept` changes as it would on the main thread, and the same files and entries come out. At
  most one step's rows (and an evaluation's batches) wait there: the loop takes each result before the
  next step's rollout.
- A tool call's crop is kept as its record names it: `crop` ([x1, y1, x2, y2], original pixels) of the
  sample's image `arguments["image"]`, which is how zoom (tools.py) makes it, cut again from the image
  decoded for the sample's own thumbnails; a returned image whose record names no crop gets "thumb_error".
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image

import data
from grpo_vlm import dataset, files

FOLDER = "thumbs"
THUMB_SIDE = 256  # pixels, longest side: a report's grid of samples, not a viewer
SEEN_SIDE = 1536  # pixels, longest side of the "seen" copy: a 4-megapixel budget stays under ~1 MB a file
# Bytes of -seen files one rank keeps per start: a photo run logs new pictures every step (8 a step of
# ~200 KB each: 1.6 GB over 1,000 steps), and a report embeds at most 64 MB of images anyway. Past it a
# picture keeps its thumbnail, and its entry's "seen" is None.
SEEN_BYTES = 256 << 20
THUMB_QUALITY, SEEN_QUALITY = 85, 90
# A moved, unreadable or undecodable file: PIL.UnidentifiedImageError is an OSError, and data.load_image
# turns its own errors into a ValueError naming the image.
KEPT_ERRORS = (OSError, ValueError)


@dataclass
class Kept:
    """What this rank has handed to the writing rank so far (for the whole run, in memory)."""

    names: set[str] = field(default_factory=set)  # thumbs/ file names whose JPEG went to the writer
    # (path, mtime_ns, bytes) -> entry: a file seen before and unchanged is not decoded again
    by_file: dict[tuple[str, int, int], dict] = field(default_factory=dict)
    seen_bytes: int = 0  # of the -seen files handed on (on a resumed run's rank 0: those in the folder too)
    unseen: set[str] = field(default_factory=set)  # keys whose -seen file the budget left out
    # `keep_aside`'s thread, made on first use, ended by close() when the run ends
    worker: ThreadPoolExecutor | None = field(default=None, repr=False, compare=False)

    def thread(self) -> ThreadPoolExecutor:
        if self.worker is None:
            self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="thumbnails")
        return self.worker

    def close(self) -> None:
        """End the thread (after the call it runs, if any; the ones not started are dropped): the run is over
        and the process exits without a thread left waiting."""
        if self.worker is not None:
            self.worker.shutdown(wait=True, cancel_futures=True)
            self.worker = None


def image_key(image: Image.Image) -> str:
    """16 hex digits of SHA-256 over the size and the RGB pixels: the same picture, the same key."""
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    digest = hashlib.sha256(f"{rgb.size[0]}x{rgb.size[1]}".encode())
    digest.update(rgb.tobytes())
    return digest.hexdigest()[:16]


def seen_size(image_processor, size: tuple[int, int]) -> tuple[int, int]:
    """(w', h') the model saw a (w, h) image at: the processor's resize (a text-only model: as it is)."""
    return size if image_processor is None else dataset.resized_size(image_processor, size)


def jpeg(image: Image.Image, quality: int) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def encode(image: Image.Image, key: str, image_processor, out: dict[str, bytes]) -> dict:
    """The entry of an RGB `image` whose key is `key`; its two JPEGs into `out` (file name -> bytes)."""
    thumb = image.copy()
    thumb.thumbnail((THUMB_SIDE, THUMB_SIDE))  # keeps the aspect ratio, never upscales
    w, h = seen_size(image_processor, image.size)
    resample = getattr(image_processor, "resample", Image.Resampling.BICUBIC)
    seen = image.resize((w, h), resample) if (w, h) != image.size else image
    if max(w, h) > SEEN_SIDE:  # NOTE: the file only: "seen_size" stays the size the model saw
        seen = seen.copy()
        seen.thumbnail((SEEN_SIDE, SEEN_SIDE))
    out[f"{key}.jpg"], out[f"{key}-seen.jpg"] = jpeg(thumb, THUMB_QUALITY), jpeg(seen, SEEN_QUALITY)
    return entry(key, image.size, (w, h))


def entry(key: str, size: tuple[int, int], seen: tuple[int, int], kept_seen: bool = True) -> dict:
    thumb, seen_file = f"{FOLDER}/{key}.jpg", f"{FOLDER}/{key}-seen.jpg" if kept_seen else None
    return {"thumb": thumb, "seen": seen_file, "size": list(size), "seen_size": list(seen)}


def seen_bytes_in(out: Path) -> int:
    """Bytes of the -seen files a run folder holds already (a resumed run's budget starts from them)."""
    folder = Path(out) / FOLDER
    return sum(p.stat().st_size for p in folder.glob("*-seen.jpg")) if folder.is_dir() else 0


def one_line(error: Exception) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def keep(
    samples: list[dict], image_processor, kept: Kept, turns: list[list[dict]] | None = None
) -> tuple[list[list[dict]], list[list[dict]] | None, dict[str, bytes]]:
    """(each sample's "thumbs" entries, aligned with its images; `turns` with each tool call's returned
    images given "thumb"; the JPEG files this rank has not handed on yet, name -> bytes). Each image is
    decoded once per call, however many rows share it (the G rows of a prompt)."""
    out: dict[str, bytes] = {}
    decoded: dict[Any, Image.Image | Exception] = {}  # image reference -> decoded RGB image or its error
    entries: dict[Any, dict] = {}  # image reference -> its entry: each image hashed once per call

    # NOTE: id() is safe here: the samples hold their images till we return
    def reference_of(image: Any) -> Any:
        return str(image) if isinstance(image, str | os.PathLike) else id(image)

    def load(image: Any, sample: dict) -> Image.Image:
        if (reference := reference_of(image)) not in decoded:
            try:
                decoded[reference] = data.load_image(image, sample)
            except KEPT_ERRORS as e:
                decoded[reference] = e
        if isinstance(result := decoded[reference], Exception):
            raise result
        return result

    def thumb(image: Any, sample: dict) -> dict:
        if (reference := reference_of(image)) not in entries:
            entries[reference] = kept_image(image, sample, load, image_processor, kept, out)
        return dict(entries[reference])

    thumbs = [[thumb(image, sample) for image in sample.get("images") or []] for sample in samples]
    if turns is not None:
        turns = [crop_thumbs(row, sample, load, kept, out) for row, sample in zip(turns, samples)]
    return thumbs, turns, out


def keep_aside(
    samples: list[dict], image_processor, kept: Kept, turns: list[list[dict]] | None = None
) -> Future:
    """`keep(samples, image_processor, kept, turns)` on `kept`'s thread, returned at once as a Future; calls
    run one at a time in the order made. NOTE: `kept` is then changed on that thread only."""
    return kept.thread().submit(keep, samples, image_processor, kept, turns)


def kept_image(
    image: Any, sample: dict, load: Callable, image_processor, kept: Kept, out: dict[str, bytes]
) -> dict:
    """One image's entry, its JPEGs into `out` unless handed on before; {"error": ...} if it is unreadable."""
    stamp = None
    if isinstance(image, str | os.PathLike):  # a file seen before, unchanged: nothing decoded
        with contextlib.suppress(OSError):  # NOTE: a file gone: data.load_image names what is wrong
            status = os.stat(image)
            stamp = (str(image), status.st_mtime_ns, status.st_size)
        if stamp in kept.by_file:
            return dict(kept.by_file[stamp])
    try:
        decoded = load(image, sample)
    except KEPT_ERRORS as e:
        return {"error": one_line(e)}
    key = image_key(decoded)
    thumb, seen = f"{key}.jpg", f"{key}-seen.jpg"
    if thumb in kept.names and (seen in kept.names or key in kept.unseen):  # handed on before
        made = entry(key, decoded.size, seen_size(image_processor, decoded.size), key not in kept.unseen)
    else:
        made = encode(decoded, key, image_processor, out)
        kept.names.add(thumb)
        if kept.seen_bytes + len(out[seen]) > SEEN_BYTES:  # NOTE: over the budget: the thumbnail only
            del out[seen]
            kept.unseen.add(key)
            made["seen"] = None
        else:
            kept.seen_bytes += len(out[seen])
            kept.names.add(seen)
    if stamp is not None:
        kept.by_file[stamp] = made
    return dict(made)


def crop_thumbs(
    row: list[dict], sample: dict, load: Callable, kept: Kept, out: dict[str, bytes]
) -> list[dict]:
    """A row's turns, each tool call's returned images with "thumb" (or "thumb_error"): copies, the
    rollout's own records (which the rewards saw) left as they are."""
    turns = []
    for turn in row:
        call = turn.get("call")
        if not call or not call.get("images"):
            turns.append(turn)
            continue
        images = [
            dict(image, **returned_thumb(image, call, sample, load, kept, out)) for image in call["images"]
        ]
        turns.append({**turn, "call": {**call, "images": images}})
    return turns


def returned_thumb(image: dict, call: dict, sample: dict, load: Callable, kept: Kept, out: dict) -> dict:
    """{"thumb": ...} of a returned crop, cut again from the sample's image as its record names it."""
    box, index = image.get("crop"), (call.get("arguments") or {}).get("image")
    if not (isinstance(box, list) and len(box) == 4 and type(index) is int):
        return {"thumb_error": "the tool's record names no crop of a sample image: not kept"}
    try:
        crop = load(sample["images"][index], sample).crop(tuple(box))
    except (*KEPT_ERRORS, IndexError) as e:
        return {"thumb_error": one_line(e)}
    if list(crop.size) != image.get("size"):
        return {"thumb_error": f"the crop {box} is {crop.size[0]}x{crop.size[1]}, not the size returned"}
    name = f"{image_key(crop)}.jpg"  # a thumbnail only: the model saw the crop inside the tool turn
    if name not in kept.names:
        thumb = crop.copy()
        thumb.thumbnail((THUMB_SIDE, THUMB_SIDE))
        out[name] = jpeg(thumb, THUMB_QUALITY)
        kept.names.add(name)
    return {"thumb": f"{FOLDER}/{name}"}


def write(out: Path, made: dict[str, bytes]) -> None:
    """The writing rank: each file into out/thumbs/, atomically, unless there already (same key, same
    picture: a resumed run, or another rank's copy)."""
    if not made:
        return
    (folder := Path(out) / FOLDER).mkdir(exist_ok=True)
    for name, content in made.items():
        if not (folder / name).exists():
            files.atomic_write(folder / name, content)
