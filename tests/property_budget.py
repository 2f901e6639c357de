"""How many examples a property test draws: ``@settings(max_examples=examples(150))``.

Each property test names the count that keeps it under a few seconds in ``make test`` (the
default profile, "ci", has hypothesis's 100 examples); a profile that draws more
(``HYPOTHESIS_PROFILE=deep``: 1000, which ``.ci/run`` runs on the property tests alone;
"dev": 500) scales every test's count by the same factor. An explicit ``max_examples`` would
otherwise stay fixed whatever the profile (tests/conftest.py registers the profiles).
"""

from __future__ import annotations

from hypothesis import settings

DEFAULT_EXAMPLES = 100     # hypothesis's own default, which the "ci" profile keeps


def examples(n: int) -> int:
    """``n`` examples under the default profile, ``n`` x (profile's examples / 100) under
    another; at least one."""
    return max(1, n * settings.default.max_examples // DEFAULT_EXAMPLES)
