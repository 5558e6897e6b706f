"""Progress off a terminal: plain lines at the first step, once per interval, and at the last step."""

from jaxspec.run import Progress


def _lines(capsys):
    return [line.split(",")[0] for line in capsys.readouterr().out.splitlines()]


def test_plain_lines_once_per_interval_and_at_the_end(capsys):
    with Progress("grpo", total=5, initial=1, interval_s=3600, terminal=False) as bar:
        for _ in range(4):
            bar.update(1, reward="0.500")
    assert _lines(capsys) == ["grpo: step 2/5 (40%)", "grpo: step 5/5 (100%)"]
    with Progress("draft", total=3, interval_s=0, terminal=False) as bar:
        for _ in range(3):
            bar.update(1, loss="1.234")
    out = capsys.readouterr().out.splitlines()
    assert [line.split(",")[0] for line in out] == [
        "draft: step 1/3 (33%)",
        "draft: step 2/3 (66%)",
        "draft: step 3/3 (100%)",
    ]
    assert all(line.endswith(" s, loss=1.234") for line in out)


def test_disabled_progress_prints_nothing(capsys):
    with Progress("pretrain", total=2, enabled=False, interval_s=0, terminal=False) as bar:
        bar.update(2)
    assert capsys.readouterr() == ("", "")
