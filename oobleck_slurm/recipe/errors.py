"""Recipe problems, reported as `file:line: key.path: message` — never a traceback."""

from __future__ import annotations

from dataclasses import dataclass

from oobleck_slurm.errors import BadInputError


@dataclass(frozen=True)
class RecipeIssue:
    """One thing wrong with a recipe: where (file, line, dotted key) and what."""

    file: str
    key: str
    message: str
    line: int | None = None

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        return f"{where}: {self.key}: {self.message}" if self.key else f"{where}: {self.message}"


class RecipeError(BadInputError):
    """A recipe could not be loaded; holds every issue found, not just the first."""

    def __init__(self, issues: list[RecipeIssue]):
        self.issues = list(issues)
        super().__init__("\n".join(str(issue) for issue in self.issues))
