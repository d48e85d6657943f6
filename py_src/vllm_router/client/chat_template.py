"""A model's chat template rendered with jinja2 as transformers' `apply_chat_template` renders it.

The client renders chats without importing transformers (seconds of imports for one
prompt); the output must be the text transformers would make, byte for byte, since the
token ids sent to the worker come from it. So this copies what transformers 4.4x-5.x set
up (utils/chat_template_utils.py): an ImmutableSandboxedEnvironment with trim_blocks and
lstrip_blocks, the loopcontrols extension, a `{% generation %}` block (rendered as its
body: the client tracks no assistant masks), a `tojson` filter that does not escape HTML,
the `raise_exception` and `strftime_now` globals, and the variables `messages`, `tools`,
`documents`, `add_generation_prompt` and the named special tokens as strings.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jinja2


class ChatTemplateError(ValueError):
    """The template is missing, ambiguous, or refused the chat (its raise_exception)."""


def select(templates: str | Mapping[str, str] | None) -> str:
    """The template a chat without tools is rendered with, as transformers picks it: the
    only one, else the one named "default"."""
    if templates is None:
        raise ChatTemplateError("the model has no chat template")
    if isinstance(templates, str):
        return templates
    if "default" not in templates:
        raise ChatTemplateError(
            f"the model has several chat templates and none named 'default': {sorted(templates)}"
        )
    return templates["default"]


def render(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str] | None = None,
) -> str:
    """`messages` rendered with `template`; `special_tokens` (bos_token, eos_token, ...) are
    variables of the template, as transformers passes its special_tokens_map."""
    import jinja2.exceptions

    try:
        return _compile(template).render(
            messages=[dict(message) for message in messages],
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **(special_tokens or {}),
        )
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"the chat template failed: {exc}") from exc


@lru_cache(maxsize=8)
def _compile(template: str) -> jinja2.Template:
    # Imported here: jinja2 is needed by chat prompts only, not by every CLI call.
    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks the assistant's text for training
        masks in transformers; rendering it is rendering its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_body")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # Jinja's own tojson escapes HTML characters; transformers' does not.
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
            sort_keys=sort_keys,
        )  # fmt: skip

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    return environment.from_string(template)
