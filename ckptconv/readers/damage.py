"""A source's files cut short (or missing) where only entries that are not read lie, found from sizes
alone: where the format records each entry's file, offset and length (DCP's `.metadata`), those
places are set against what each file holds, and the bytes of the entries are never read (they are
left unread so that what is not written costs nothing: docs/dcp.md, "A damaged checkpoint"). An
entry that is read and lies past its file's end stays the reader's refusal (exit 2); this says what
would otherwise go unseen, in the source's facts (`SourceFacts.damaged`) and one line. Registers
nothing.
"""
from ..errors import printable

MAX_FILES = 1000     # damaged files recorded (each with its count and first entry); the line counts them all


def survey(places, size_of) -> list:
    """`places`: (file, entry, start, stop) of the entries not read; `size_of(file)`: the bytes the
    file holds, None when it is missing, or -1 when it is not looked at (a link leading out of the
    source: never followed); asked once a file. Returns the records of the files
    whose entries reach past their end, sorted by name (the first MAX_FILES): {"file", "has" (its
    bytes; None: missing), "needs" (the end of its last entry), "entries" (how many lie past its
    end), "first" {"entry", "start", "stop"} (the first of those in the file)}."""
    needs = {}
    for file, _, _, stop in places:
        if stop > needs.get(file, 0):
            needs[file] = stop
    has = {}
    for file, end in needs.items():
        size = size_of(file)
        if size is None or 0 <= size < end:
            has[file] = size
    if not has:
        return []
    records = {}
    for file, entry, start, stop in places:
        if file not in has or has[file] is not None and stop <= has[file]:
            continue
        r = records.get(file)
        if r is None:
            r = records[file] = {"file": file, "has": has[file], "needs": needs[file], "entries": 0,
                                 "first": {"entry": entry, "start": start, "stop": stop}}
        r["entries"] += 1
        if start < r["first"]["start"]:
            r["first"] = {"entry": entry, "start": start, "stop": stop}
    return [records[f] for f in sorted(records)[:MAX_FILES]]


def line(damaged: list, root) -> str:
    """One line for a source's damaged files (`damaged`: survey's records, their names relative to
    `root`): the first in full, the others named."""
    if not damaged:
        return ""
    d, first = damaged[0], damaged[0]["first"]
    n = f"{d['entries']} entr{'y' if d['entries'] == 1 else 'ies'}"
    where = f"{str(root).rstrip('/')}/{d['file']}"
    what = (f"missing, and {n} {'lies' if d['entries'] == 1 else 'lie'} in it" if d["has"] is None else
            f"holds {d['has']} of the {d['needs']} bytes its entries need: {n} cut short or absent")
    entry = printable(repr(first["entry"]), 300)
    text = (f"{where}: damaged: {what} (first {entry}, bytes {first['start']}..{first['stop']}), none of them "
            "written; the tensors written are whole")
    more = len(damaged) - 1
    if more:
        shown = ", ".join(printable(r["file"], 200) for r in damaged[1:5])
        count = f"{more}{' or more' if len(damaged) == MAX_FILES else ''}"
        text += (f"; {count} more damaged file{'s' if more > 1 else ''} alike: {shown}"
                 + (f" and {more - 4} more" if more > 4 else ""))
    return printable(text)
