"""Files the full trainer writes whole: a crash or a full disk never leaves half of one; errors name them.

Choices:
- Every file is written whole (`atomic_write`: a temporary file beside it, fsynced, then renamed over the old
  one), and a failed write's OSError names the file (the kernel's names none). checkpoints.py writes through
  these, and the trainer passes `atomic_write` to `model_io.save_adapter`. A file to read must be a regular
  one (`regular_file`: a FIFO would block the read).
- `save_model` writes a whole model folder as `from_pretrained` reads it (merge first: `lora.unload_lora`).
"""

import json
import os
import uuid
from pathlib import Path


def regular_file(path: str | Path) -> Path:
    """`path`, refused unless a regular file: opening a FIFO would wait for a writer, deaf to signals."""
    if (path := Path(path)).exists() and not path.is_file():  # is_file: stat.S_ISREG
        raise ValueError(f"{path} is not a regular file; refusing to read it")
    return path


def read_json(path: str | Path) -> object:
    """The JSON in `path`, a regular file; a ValueError naming it when it is not UTF-8, not JSON (an integer
    of more than 4,300 digits included) or nested too deeply."""
    raw = regular_file(path).read_bytes()
    try:
        return json.loads(raw.decode("utf-8"))
    except RecursionError as e:  # json's parser recurses once per '[' or '{'
        raise ValueError(f"{path}: JSON nested too deeply") from e
    except ValueError as e:  # UnicodeDecodeError, JSONDecodeError, int's digit limit
        raise ValueError(f"{path}: not a JSON file ({e})") from e


def write_file(path: Path, content: bytes, *, name: str | Path | None = None) -> None:
    """Write `content` to `path` and fsync it. The OSError of a failed write (no space left, ...) names no
    file; here it names `name` (default `path`), so the one-line error can say which."""
    try:
        with path.open("wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.filename is not None and str(e.filename) != str(path):
            raise
        raise OSError(e.errno, e.strerror, str(name or path)) from e


def atomic_write(path: str | Path, content: bytes) -> None:
    """Write a temp file beside `path`, fsync it and rename it over `path`: a reader or a crash sees the old
    or the new file, never half of one (the folder is not fsynced: a lost rename brings back the old file)."""
    tmp = Path(path).with_name(f".{Path(path).name}.{uuid.uuid4().hex}.tmp")
    try:
        write_file(tmp, content, name=path)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def save_model(model, tokenizer, image_processor, directory: str | Path) -> None:
    """`save_pretrained` model, tokenizer and image processor into one folder (merge: `lora.unload_lora`)."""
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    if image_processor is not None:
        image_processor.save_pretrained(directory)
