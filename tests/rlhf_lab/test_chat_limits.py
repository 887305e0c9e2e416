"""`rlhf-lab chat` bounds what one message and one reply take (issue 36): the page's turn
function (`rlhf_lab.chat.respond`, what the Send button runs) with the tiny-qwen3 model answers
hostile input (200,000 characters, binary and control characters, empty, a conversation longer
than the model takes, absurd settings) within seconds and with a visible note, and never raises
(an exception there reached the page as an empty AppError after the streamer's 120 s timeout).
The browser test (tests/rlhf_lab/test_chat.py) sends the 200,000 characters through the page.
"""

from __future__ import annotations

import time

import pytest

from rlhf_lab.chat import ChatLimits, clean_message, fit_prompt, load_chat_model, respond


@pytest.fixture(scope="module")
def tiny():
    return load_chat_model("tiny-qwen3")


def turn(models, text, *, limits=None, temperature=0.0, budget=16):
    """Run one turn to its end: (seconds, the last yield's message box, histories, notes,
    notice)."""
    start, n = time.monotonic(), len(models)
    yields = list(respond(models, None, limits or ChatLimits(), text, temperature, 1.0, budget,
                          *[[] for _ in models]))  # fmt: skip
    last = yields[-1]
    return (
        time.monotonic() - start,
        last[0],
        list(last[1 : 1 + n]),
        list(last[1 + n : -1]),
        last[-1],
    )


def test_a_message_is_cleaned_or_refused_with_a_note():
    limits = ChatLimits()
    message, note = clean_message("x" * 200_000, limits)
    assert message is None and "200,000 characters" in note and "8,000" in note
    message, note = clean_message("\x00\x01ab\x7fc\r\nd\ud800e\x9b", limits)
    assert message == "abc\nd?e"
    assert "4 control characters removed" in note and "1 invalid characters" in note
    assert clean_message("   \n ", limits) == (None, "Message not sent: it is empty.")
    message, note = clean_message("\x00\x00\x07", limits)
    assert message is None and "empty" in note and "3 control characters" in note
    assert clean_message("hello", limits) == ("hello", "")
    assert clean_message(None, limits)[0] is None  # what a broken client may send


def test_a_conversation_is_cut_to_the_prompt_budget_oldest_turns_first(tiny):
    tok = tiny.tokenizer
    history = []
    for i in range(6):
        history += [{"role": "user", "content": f"question {i} " * 20},
                    {"role": "assistant", "content": f"answer {i} " * 20}]  # fmt: skip
    history.append({"role": "user", "content": "the last question"})
    ids, note = fit_prompt(tok, history, 120)
    assert len(ids) <= 120 and "oldest" in note and "message(s) were left out" in note
    assert "the last question" in tok.decode(ids)  # the newest message is kept whole
    ids, note = fit_prompt(tok, [{"role": "user", "content": "abc " * 3000}], 100)
    assert len(ids) <= 100 and "your message was cut to its first" in note
    ids, note = fit_prompt(tok, history[-1:], 100)
    assert note == "" and len(ids) < 100


def test_hostile_messages_are_answered_within_seconds_with_a_visible_note(tiny):
    models = [tiny, tiny]
    seconds, box, histories, notes, notice = turn(models, "y" * 200_000)
    assert seconds < 2 and "Message not sent: it has 200,000 characters" in notice
    assert box == "y" * 200_000 and histories == [[], []]  # kept in the box, nothing sent

    seconds, box, histories, notes, notice = turn(models, "\x00\x01hi\x7f\ud800 there\x1b")
    assert seconds < 60 and "control characters removed" in notice and "'?'" in notice
    assert box == "" and all(h[-2]["content"] == "hi? there" for h in histories)
    assert all(h[-1]["role"] == "assistant" and h[-1]["content"] for h in histories)

    seconds, box, histories, notes, notice = turn(models, "")
    assert seconds < 2 and notice == "Message not sent: it is empty." and histories == [[], []]

    # a message under the character limit but far over the model's 512 positions
    limits = ChatLimits(max_message_chars=20_000)
    seconds, box, histories, notes, notice = turn([tiny], "abc " * 4000, limits=limits)
    assert seconds < 60 and "Prompt cut to" in notes[0] and "your message was cut" in notes[0]

    # absurd settings from a client: a budget past the model (capped at half of tiny-qwen3's
    # 512 positions, or at --max-new-tokens), one that is not a number
    limits = ChatLimits(max_seconds=0.5)
    seconds, box, histories, notes, notice = turn([tiny], "hello", budget=10**9, limits=limits)
    assert seconds < 30 and "1,000,000,000 capped at 256" in notes[0]
    limits = ChatLimits(max_new_tokens=8)
    seconds, box, histories, notes, notice = turn([tiny], "hello", budget=10**9, limits=limits)
    assert seconds < 30 and "capped at 8" in notes[0]
    seconds, box, histories, notes, notice = turn([tiny], "hello", budget=None)
    assert seconds < 5 and "Failed: TypeError" in notes[0]
    assert histories[0][-1]["content"] == "(empty reply)"


def test_a_reply_stops_at_the_time_limit_with_a_note(tiny):
    limits = ChatLimits(max_seconds=0.05)
    seconds, box, histories, notes, notice = turn([tiny], "hello", limits=limits, budget=256,
                                                  temperature=0.0)  # fmt: skip
    assert seconds < 10 and "Stopped after 0.05 s" in notes[0], notes
