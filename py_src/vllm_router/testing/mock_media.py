"""How the mock engine takes media: placeholders counted, content folded into the prompt.

A mock started with `image_token_id` set takes images (up to `max_images` per prompt):
each item sent as bytes needs one placeholder token in the prompt (vLLM's processor
would expand it), processed items carry their runs already. The mock decodes nothing;
it folds each item's content digest into the prompt it "decodes" from, so a different
image gives different tokens and the same image the same tokens, as a real model would.
"""

from __future__ import annotations

import hashlib

from ..engine import GenerationRequest
from ..errors import InvalidRequest
from .mock_config import MockConfig


def media_limits(config: MockConfig) -> dict[str, int]:
    return {"image": config.max_images} if config.image_token_id else {}


def prompt_with_media(request: GenerationRequest, config: MockConfig) -> list[int]:
    """The token ids the mock generates from: the prompt, then one id per item's content."""
    ids = list(request.prompt_token_ids or ())
    if not request.media and not request.processed_media:
        return ids
    if not config.image_token_id:
        raise InvalidRequest(f"{request.media_field}: this (mock) model takes no media")
    placeholders = ids.count(config.image_token_id)
    if request.media and placeholders != len(request.media):
        raise InvalidRequest(
            f"{request.media_field}: {len(request.media)} images sent but the prompt has "
            f"{placeholders} placeholder tokens ({config.image_token_id})"
        )
    contents = [item.uuid.encode() if item.uuid else item.data or b"" for item in request.media]
    contents += [h.encode() for batch in request.processed_media for h in batch.hashes]
    return ids + [
        int.from_bytes(hashlib.sha256(content).digest()[:4], "big") % config.vocab_size
        for content in contents
    ]
