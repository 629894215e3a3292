"""The base of every config section, the core's and each plugin's own options (a method's `Options`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: an unknown key is an error (it names the key), and an assignment is validated too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
