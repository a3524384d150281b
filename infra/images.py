"""Image references in the specs: pinned by a digest a registry served, or marked placeholders.

A spec names each image in one of two forms:

- `name[:tag]@sha256:<64 hex>`: pinned by the digest a registry served for it (what
  `pdctl images --write` writes);
- `{ref: name:tag, digest: placeholder}`: an image not built or not resolved yet. The model holds
  it as `name:tag`, the reference without a digest, which is what it renders as: the policy
  pack's "pinned by digest" rule refuses it, so `pulumi up` does, and `pdctl rollout` refuses it
  against a real stack before any change. Previews name every placeholder.

Nothing else reaches the model: a reference without a digest must say that it is a placeholder,
so a digest can never be left out by accident. A placeholder serialises back to the marked form
(mode="json"), so a spec that went through a release record or `render --engine` reads the same.
"""

from __future__ import annotations

from typing import Annotated, Any, Iterator

from pydantic import BaseModel, BeforeValidator, PlainSerializer

from infra.naming import OCI_DIGEST_REFERENCE, OCI_TAGGED_REFERENCE

PLACEHOLDER = "placeholder"
RESOLVE_FIX = "build and push it, then `pdctl images --stack <env> --write <spec>` pins the digest the registry serves"


def _shown(value: Any) -> str:
    return repr(str(value)[:80])


def image_reference(value: Any) -> Any:
    """The reference a spec's image value stands for: `name[:tag]@digest` as written, or a marked
    placeholder's `name:tag`; anything else is refused (ValueError naming the fix)."""
    if isinstance(value, dict):
        if set(value) != {"ref", "digest"} or value.get("digest") != PLACEHOLDER:
            raise ValueError(f"image {_shown(value)}: the mapping form marks a placeholder, exactly "
                             "{ref: name:tag, digest: placeholder}. Fix: that, or name@sha256:<64 hex digits>")
        ref = value["ref"]
        if not isinstance(ref, str) or not OCI_TAGGED_REFERENCE.fullmatch(ref):
            raise ValueError(f"image {_shown(ref)}: a placeholder's ref is the reference it will be pushed as, "
                             "[registry/]path:tag (OCI distribution grammar, no digest). Fix: e.g. "
                             "docker.io/amazon/aws-cli:2.27.0")
        return ref
    if isinstance(value, str) and not OCI_DIGEST_REFERENCE.fullmatch(value):
        raise ValueError(
            f"image {_shown(value)} is not an image reference pinned by digest (OCI distribution grammar: "
            "[registry/]path[:tag]@sha256:<64 hex>). Fix: use name@sha256:<64 hex digits>, or, for an image "
            "not built yet, {ref: name:tag, digest: placeholder}")
    return value


def _marked(value: str) -> str | dict[str, str]:
    return {"ref": value, "digest": PLACEHOLDER} if is_placeholder(value) else value


class _ImageField:
    """Marks a field as an image reference, so `image_fields` finds every one."""


ImageRef = Annotated[str, BeforeValidator(image_reference), PlainSerializer(_marked, when_used="json"), _ImageField()]


def is_placeholder(ref: str) -> bool:
    """A reference the model holds without a digest is a marked placeholder (nothing else passes)."""
    return "@" not in ref


def image_tag(ref: str) -> str | None:
    """The tag of `[registry[:port]/]path[:tag][@digest]`, or None when it names none."""
    name = ref.partition("@")[0]
    last = name.rpartition("/")[2]
    return last.rpartition(":")[2] if ":" in last else None


def platform_key(ref: str) -> str:
    """What `images.platforms` keys `ref`'s platforms by: its digest, or a placeholder's own reference
    (the platforms it is to be built for)."""
    return ref if is_placeholder(ref) else ref.rpartition("@")[2]


def image_fields(model: BaseModel, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(dotted field, reference) of every image a spec (serving or platform) names."""
    for name, info in type(model).model_fields.items():
        value, path = getattr(model, name), f"{prefix}{name}"
        if any(isinstance(m, _ImageField) for m in info.metadata) or _optional_image(info.annotation):
            if value is not None:
                yield path, value
        elif isinstance(value, BaseModel):
            yield from image_fields(value, f"{path}.")
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(item, BaseModel):
                    yield from image_fields(item, f"{path}.{key}.")


def _optional_image(annotation: Any) -> bool:
    """`ImageRef | None`: the marker sits on the union's member."""
    from typing import get_args

    return any(isinstance(m, _ImageField) for arg in get_args(annotation) for m in getattr(arg, "__metadata__", ()))


def placeholders(spec: BaseModel) -> dict[str, str]:
    """Every marked placeholder of a spec, by field."""
    return {field: ref for field, ref in image_fields(spec) if is_placeholder(ref)}


def placeholder_lines(spec: BaseModel) -> list[str]:
    """One line per placeholder, as every preview prints them."""
    return [f"placeholder image: {field} = {ref} (no digest a registry served; `pulumi up` and `pdctl rollout` "
            f"refuse it. Fix: {RESOLVE_FIX})" for field, ref in placeholders(spec).items()]
