"""The one error type of the device-map compiler."""
from __future__ import annotations


class PlacementError(ValueError):
    """A job that cannot be placed on a cluster; the message names the role, the field and a fix."""
