"""What verify finds: each problem as one line naming the file and the tensor (`Problem`, of one of
`KINDS`), and the report gathering them with what was checked (`Report`)."""
from dataclasses import dataclass, field

from ..errors import BadInput, printable


# What a problem is about (docs/verify.md#problems): a listed file or tensor that is absent; one present
# that nothing lists; one in another place than listed, or twice; bytes whose digest or size differs;
# a metadata file or header that is malformed or disagrees; an entry that is not a regular file; one
# that cannot be read; what the safetensors library sees differing from ckptconv; rank pieces that do
# not fit mesh.json; a tensor that differs from the --against source; an output in an object store
# whose pointer was never written (docs/storage.md).
KINDS = ("missing", "unlisted", "misplaced", "digest", "metadata", "not-regular", "unreadable", "consumer", "mesh",
         "source", "identity", "device", "unpublished")


@dataclass(frozen=True)
class Problem:
    """One finding: its kind, the file it is in, the tensor it concerns (if one), what is wrong."""

    kind: str
    file: str
    detail: str
    tensor: str | None = None

    def __str__(self) -> str:
        return printable(f"{self.file}: {self.detail}")   # a file called "a\nb" stays one line

    def to_json(self) -> dict:
        """The fields as they are (JSON escapes what it must); `message` is the printed line."""
        return {"kind": self.kind, "file": self.file, "tensor": self.tensor, "detail": self.detail,
                "message": str(self)}


@dataclass
class Report:
    problems: list = field(default_factory=list)   # Problem
    files: int = 0
    tensors: int = 0
    bytes: int = 0
    device: object = None    # jobs/verify/device.DeviceFacts after --device
    shared: int = 0   # problems already merged across processes
    notes: list = field(default_factory=list)   # checks that could not be done, and how it compared
    expected: bool = False   # --expect was given and the output is that one
    foreign: bool = False    # an output ckptconv did not write: no digests were recorded to check

    def add(self, where, what: str, kind: str, tensor: str | None = None):
        assert kind in KINDS, kind
        self.problems.append(Problem(kind, str(where), what, tensor))

    @property
    def ok(self) -> bool:
        return not self.problems


def _detail(error: BadInput, path) -> str:
    """A BadInput's sentence without the "PATH: " it starts with (the problem line names the file
    already), also when the path itself holds ": "."""
    text, head = str(error), f"{path}: "
    return text[len(head):] if text.startswith(head) else text.split(": ", 1)[-1]
