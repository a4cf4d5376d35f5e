"""Test-wide settings: every plan the runtime makes is checked against its counts
(a debugging aid that training leaves off)."""

import os

os.environ.setdefault("LRMOE_CHECK_PLANS", "1")
