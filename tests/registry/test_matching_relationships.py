"""Relationship conditions of cached pages, tested against a changed entry by lookups
(`Facts.relationship_index`): the same answers as testing every element (jsonb containment),
or "maybe" where that answer would be unsure; never a wrong yes or no."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from registry.matching import Maybe, _all, _any, _same_json, facts_of, may_match
from registry.query import HasRelationship, InList, RegistryQuery

_values = st.sampled_from(["a", "b", "did:web:x", True, False, 0, 1, 2, 1.5, None])
_keys = st.sampled_from(["relationshipType", "targetDid", "note"])
_element = st.one_of(
    st.dictionaries(_keys, _values | st.lists(_values, max_size=2), max_size=3),
    _values,  # not an object
)


def _every_element(relationships: list[Any], wanted: dict[str, Any]) -> Maybe:
    """The reference: each element tested in turn (what matching did before the index)."""
    results: list[Maybe] = []
    for element in relationships:
        if not isinstance(element, dict):
            results.append(None)
            continue
        results.append(
            _all([_same_json(element[k], v) if k in element else False for k, v in wanted.items()])
        )
    return _any(results)


def _facts(relationships: list[Any]) -> Any:
    doc = {"entryDid": "did:web:e", "entryType": "AgentDefinition", "publisherDid": "did:key:z"}
    facts = facts_of(json.dumps({**doc, "relationships": relationships}))
    assert facts is not None
    return facts


def _agrees(found: Maybe, reference: Maybe) -> bool:
    return found == reference or found is None  # "maybe" is always safe


@settings(max_examples=400)
@given(st.lists(_element, max_size=5), st.dictionaries(_keys, _values, min_size=1, max_size=2))
def test_a_relationship_condition_answers_as_testing_every_element(
    relationships: list[Any], wanted: dict[str, Any]
) -> None:
    from registry.matching import _has_relationship

    found = _has_relationship(_facts(relationships), wanted)
    reference = _every_element(relationships, wanted)
    assert _agrees(found, reference), (found, reference)
    if reference is True:
        assert found is True


@settings(max_examples=400)
@given(st.lists(_element, max_size=5), _keys, st.lists(_values, min_size=1, max_size=4))
def test_a_relationship_in_list_answers_as_testing_every_value(
    relationships: list[Any], key: str, values: list[Any]
) -> None:
    query = RegistryQuery(where=InList(f"relationships.{key}", tuple(values)))
    found = may_match(query, _facts(relationships))
    reference = _any([_every_element(relationships, {key: v}) for v in values])
    # may_match answers True for "yes or maybe": a reference yes or maybe must be a True.
    if reference is not False:
        assert found is True
    if found is False:
        assert reference is False


def test_true_is_not_one_and_a_pair_must_be_on_one_element() -> None:
    from registry.matching import _has_relationship

    facts = _facts(
        [{"relationshipType": "dependsOn", "targetDid": "did:web:a", "flag": 1}, {"x": True}]
    )
    assert _has_relationship(facts, {"flag": 1}) is True
    assert _has_relationship(facts, {"flag": True}) is False
    assert _has_relationship(facts, {"x": 1}) is False
    both = HasRelationship("dependsOn", "did:web:a")
    assert may_match(RegistryQuery(where=both), facts) is True
    split = {"relationshipType": "dependsOn", "x": True}  # on two different elements
    assert _has_relationship(facts, split) is False
