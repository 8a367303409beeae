"""Test-wide settings: hypothesis draws a fixed sequence of examples under CI (CI=true), random
examples elsewhere, so a CI run is reproducible while local runs keep exploring."""

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")
