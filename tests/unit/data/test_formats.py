"""Format detection explains itself; rows become examples, or say what is wrong with them."""

import pytest

from tunecast.data.formats import ALPACA_NO_INPUT, detect_format, to_example
from tunecast.data.readers import BadRow, Row
from tunecast.errors import TunecastError


def example(data: dict, layout: str, train_on: str = "completion"):  # type: ignore[no-untyped-def]
    return to_example(Row(1, 7, data), layout, train_on)


@pytest.mark.parametrize(("record", "layout"), [
    ({"text": "x"}, "text"),
    ({"prompt": "p", "completion": "c"}, "prompt-completion"),
    ({"instruction": "i", "input": "", "output": "o"}, "alpaca"),
    ({"conversations": [{"from": "human", "value": "q"}]}, "sharegpt"),
    ({"messages": [{"role": "user", "content": "q"}]}, "messages"),
])
def test_detection(record, layout) -> None:
    detection = detect_format([record] * 10)
    assert detection.format == layout
    assert detection.explanation.startswith(f"detected {layout}: fields") and "100% of the first 10 rows" in \
        detection.explanation


def test_undetectable_data_lists_the_fields_it_saw() -> None:
    with pytest.raises(TunecastError, match=r"question \(100%\)") as error:
        detect_format([{"question": "q", "answer": "a"}] * 5)
    assert "dataset.format" in (error.value.field or "")


def test_alpaca_uses_the_stanford_template_and_trains_the_output() -> None:
    result = example({"instruction": "Add 2 and 3.", "input": "", "output": "5"}, "alpaca")
    prompt, completion = result.segments
    assert prompt.text == ALPACA_NO_INPUT.format(instruction="Add 2 and 3.", input="")
    assert (prompt.trained, completion.trained, completion.text) == (False, True, "5")


def test_sharegpt_roles_map_to_chat_roles() -> None:
    result = example({"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                                        {"from": "gpt", "value": "a"}]}, "sharegpt")
    assert [(s.role, s.trained) for s in result.segments] == [("system", False), ("user", False),
                                                              ("assistant", True)]
    everything = example({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
                         "sharegpt", train_on="all")
    assert all(s.trained for s in everything.segments)


@pytest.mark.parametrize(("record", "layout", "message"), [
    ({"prompt": "p"}, "prompt-completion", "has no 'completion' field"),
    ({"text": 5}, "text", "'text' is int, not text"),
    ({"messages": []}, "messages", "empty conversation"),
    ({"messages": [{"role": "user", "content": "q"}]}, "messages", "no assistant turn"),
    ({"messages": [{"role": "wizard", "content": "q"}]}, "messages", "unknown role 'wizard'"),
    ({"conversations": [{"from": "human"}]}, "sharegpt", "needs 'from' and 'value'"),
])
def test_bad_rows_say_where_and_what(record, layout, message) -> None:
    result = example(record, layout)
    assert isinstance(result, BadRow) and message in result.message and result.line == 7
