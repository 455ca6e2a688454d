"""The two user-facing error kinds: malformed input (SpecError) and plans that do not fit (InfeasiblePlan).

Both carry a one-line message; the CLI prints it and exits with code 2, without a traceback.
"""


class SpecError(ValueError):
    """A file or option is malformed: names the file (or option), the field and what was expected."""

    def __init__(self, where: str, field: str, expected: str):
        self.where, self.field, self.expected = where, field, expected
        super().__init__(f"{where}: field '{field}': {expected}")


class InfeasiblePlan(ValueError):
    """A well-formed plan that cannot run: names what overflows and by how much."""

    def __init__(self, what: str, need_bytes: float, have_bytes: float, detail: str = ""):
        self.what, self.need_bytes, self.have_bytes = what, need_bytes, have_bytes
        gib = 2**30
        msg = (
            f"infeasible plan: {what} needs {need_bytes / gib:.2f} GiB but has "
            f"{have_bytes / gib:.2f} GiB (over by {(need_bytes - have_bytes) / gib:.2f} GiB)"
        )
        super().__init__(msg + (f"; {detail}" if detail else ""))
