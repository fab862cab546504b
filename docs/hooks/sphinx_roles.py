"""MkDocs hook: the docstrings' Sphinx roles read as code in the API reference.

posenc's docstrings cross-reference with reStructuredText roles (``:class:`~posenc.KVCache```), which
mkdocstrings renders as the role's name followed by the code span (``:class:<code>~posenc.KVCache</code>``).
This hook drops the role and, as Sphinx does for a leading ``~``, keeps the last name of the path.
Registered in ``mkdocs.yml`` (``hooks:``); the docstrings themselves stay as they are.
"""

from __future__ import annotations

import re

ROLE = re.compile(
    r":(?:py:)?(?:class|func|meth|attr|mod|data|obj|exc|const):<code>(?P<tilde>~?)(?P<path>[^<]+)</code>"
)


def _code(match: re.Match[str]) -> str:
    path = match.group("path")
    return f"<code>{path.rsplit('.', 1)[-1] if match.group('tilde') else path}</code>"


def on_page_content(html: str, **kwargs: object) -> str:
    return ROLE.sub(_code, html)
