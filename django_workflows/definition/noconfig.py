"""The config model of a stage without configuration (a leaf module: both
:mod:`.stage` and :mod:`.context` use it, and :mod:`.stage` reads :mod:`.context`'s
``StageContext`` when it inspects an ``execute`` function's annotations).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class NoConfig(BaseModel):
    """The config model of a stage without configuration."""

    model_config = ConfigDict(extra="ignore")


__all__ = ["NoConfig"]
