"""grpo_vlm/dataset.py's reading of what the reference's data.py reads in short: JSONL errors with the column
of the fault, a hint for the usual JSON mistakes and the text around it; a prompt longer than
--max-prompt-length refused when the data loads."""

import re

import pytest
import test_data
from test_data import GOOD, solid

import data
from grpo_vlm import dataset

tiny = test_data.tiny  # the embedded asset, loaded once (the reference tests' fixture)


def test_prompt_longer_than_max_prompt_length_raises_naming_the_sample(tiny):
    _, tok, ip = tiny
    sample = {
        "id": "long-7",
        "images": [solid(112, 112, (9, 9, 9))],
        "prompt": "inspect the installation. " * 5,
    }
    P = data.prepare_prompts([sample], tok, ip, device="cpu").inputs["input_ids"].shape[1]
    assert dataset.check_samples([sample], tok, ip, max_prompt_length=P).longest_prompt == P  # kept whole
    with pytest.raises(
        ValueError, match=rf"sample long-7: prompt is {P} tokens.*max_prompt_length is {P - 1}"
    ):
        dataset.check_samples([sample], tok, ip, max_prompt_length=P - 1)


# Each line with the 1-based column of the character at fault, counted by hand, and the hint expected.
JSON_MISTAKES = [
    # "x" closes at column 26, its comma is column 27; json notices only the '}' at column 28.
    ('{"id": "a1", "prompt": "x",}', 27, "a trailing comma before '}'"),
    # 26 characters, then the line ends where a ',' or '}' should follow: column 27.
    ('{"id": "a1", "prompt": "x"', 27, "a missing '}'"),
    # The key's opening quote is the second character.
    ('{\'id\': "a1", "prompt": "x"}', 2, "JSON needs double quotes"),
    # Cut inside a key: the unterminated string opens at column 14.
    ('{"id": "a1", "pro', 14, "the line ends inside this string"),
]


@pytest.mark.parametrize("newline", ["\n", "\r\n"], ids=["lf", "crlf"])
@pytest.mark.parametrize(
    ("line", "column", "hint"), JSON_MISTAKES, ids=["trailing-comma", "no-brace", "single-quotes", "cut"]
)
def test_invalid_json_names_file_line_and_the_real_column_with_a_hint_and_the_line(
    tmp_path, newline, line, column, hint
):
    path = tmp_path / "data.jsonl"
    path.write_bytes(newline.join([GOOD, "", line, GOOD]).encode() + newline.encode())
    with pytest.raises(ValueError) as raised:
        dataset.read_jsonl(path)
    message = str(raised.value)
    assert "\n" not in message
    assert re.match(rf"{re.escape(str(path))}:3:{column}: invalid JSON: .*{re.escape(hint)}", message)
    assert message.endswith("; near: " + line)  # a short line is shown whole


def test_a_long_line_is_shown_around_the_fault_only(tmp_path):
    line = '{"prompt": "' + "图" * 300 + '", "id": 1,}'
    path = tmp_path / "data.jsonl"
    path.write_text(line + "\n", encoding="utf-8")
    with pytest.raises(ValueError) as raised:
        dataset.read_jsonl(path)
    message = str(raised.value)
    assert f":1:{len(line) - 1}: invalid JSON: " in message  # the comma before the last '}'
    excerpt = message.split("; near: ")[1]
    assert excerpt.startswith("...图") and excerpt.endswith('", "id": 1,}') and len(excerpt) < 70


def test_json_nested_too_deeply_for_the_parser_names_file_and_line(tmp_path):
    path = tmp_path / "data.jsonl"
    deep = '{"prompt": "a", "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    path.write_text(f"{GOOD}\n\n{deep}\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:3: JSON nested too deeply$"):
        dataset.read_jsonl(path)
