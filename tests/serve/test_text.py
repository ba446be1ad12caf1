"""``TextStream``: a completion's text as its tokens come, held back while it could begin a
stop string or ends in an incomplete character, cut at a stop string, the last piece
included (``flush``)."""

from __future__ import annotations

from stmoe.serve.text import TextStream


class _Job:
    def __init__(self) -> None:
        self.output: list[int] = []
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class _Service:
    """Token i decodes to ``pieces[i]``; the text of several is theirs joined."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def text(self, tokens: list[int], n: int) -> str:
        return "".join(self.pieces[t] for t in tokens[:n])


def _run(pieces: list[str], stops: list[str]) -> tuple[list[str], str, TextStream, _Job]:
    """Every token pushed, then the flush: (what each push sent, the flush's, the stream)."""
    job = _Job()
    stream = TextStream(_Service(pieces).text, job, stops)
    sent = []
    for t in range(len(pieces)):
        job.output.append(t)
        sent.append(stream.push())
    return sent, stream.flush(), stream, job


def test_a_stop_string_cuts_the_text_and_cancels_the_job():
    sent, rest, stream, job = _run(["ab", "c", "STOP", "de"], ["STOP"])
    assert "".join(sent) + rest == "abc" and stream.text == "abc"
    assert stream.stopped and job.cancelled


def test_a_tail_that_may_begin_a_stop_string_is_held_then_sent():
    sent, rest, stream, _ = _run(["ab", "ST", "x"], ["STOP"])
    assert sent == ["ab", "", "STx"] and rest == "" and not stream.stopped


def test_the_last_piece_has_its_stop_strings_applied():
    """The last token ends in an incomplete character, so ``push`` sent nothing for it: the
    stop string it completes is found at the flush, not sent."""
    sent, rest, stream, job = _run(["ab", "cSTOP\ufffd"], ["STOP"])
    assert sent == ["ab", ""]
    assert rest == "c" and stream.text == "abc" and stream.stopped and job.cancelled
    assert stream.final() == "abc"


def test_the_last_piece_is_sent_whole_without_a_stop():
    sent, rest, stream, _ = _run(["ab", "ST"], ["STOP"])
    assert sent == ["ab", ""] and rest == "ST" and stream.final() == "abST"
    assert not stream.stopped


def _run_late(pieces: list[str], stops: list[str], every: int) -> TextStream:
    """The same tokens, the stream pushed only after every ``every``-th (an event loop
    running late: several tokens at once), then flushed."""
    job = _Job()
    stream = TextStream(_Service(pieces).text, job, stops)
    for t in range(len(pieces)):
        job.output.append(t)
        if (t + 1) % every == 0:
            stream.push()
    stream.flush()
    return stream


CASES = [
    (["ab", "c", "ST", "OP", "de", "f", "g"], ["STOP"]),           # completed at token 3
    (["x", "ab", "cd", "e", "bc"], ["abcd", "bc"]),                # overlapping stops
    (["a", "b\ufffd", "\ufffd", "c", "STOP", "z", "z"], ["cST"]),  # incomplete characters
    (["hello", " wor", "ld", "!"], ["NOPE"]),                       # no stop
]


def test_the_text_and_its_tokens_do_not_depend_on_how_late_the_pushes_come():
    """Another client's load delays the event loop; what the completion is (its text, the
    tokens counted and given log-probabilities: ``used``) must not change with it."""
    for pieces, stops in CASES:
        sent, rest, want, _ = _run(pieces, stops)
        for every in (2, 3, len(pieces) + 1):  # the last: only the flush reads them
            got = _run_late(pieces, stops, every)
            assert (got.text, got.used, got.stopped) == (want.text, want.used, want.stopped), (
                pieces, stops, every)
            assert got.sent == "".join(sent) + rest


def test_used_stops_at_the_token_that_completed_the_stop_string():
    _, _, stream, _ = _run(["ab", "c", "ST", "OP", "de", "f"], ["STOP"])
    assert stream.used == 4 and stream.text == "abc"
    late = _run_late(["ab", "c", "ST", "OP", "de", "f"], ["STOP"], 6)
    assert late.used == 4 and late.text == "abc"


def test_a_stop_string_in_rewritten_earlier_text_is_found():
    """Each push searches only where a stop string could newly begin, unless the text no
    longer goes on from the last one read (a decoder that rewrote it): then all of it."""
    texts = ["", "hello world", "STOP world!!"]  # the second token rewrites the first's text
    job = _Job()
    stream = TextStream(lambda tokens, n: texts[n], job, ["STOP"])
    job.output.append(0)
    assert stream.push() == "hello world"
    job.output.append(1)
    stream.push()
    assert stream.stopped and stream.text == "" and job.cancelled
