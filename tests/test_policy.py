"""The team's policy file (rules/policyfile.py): every problem one line naming its place."""

from __future__ import annotations

import pytest

from provision.core.errors import ValidationError
from provision.rules.policyfile import from_json, parse, to_json
from provision.rules.priority import DEFAULT_CLASSES, DevPolicy, Policy
from provision.rules.tenancy import identity

KNOWN = {"ana@lab", "bob@lab", "carol@lab"}


def test_a_whole_policy() -> None:
    p = parse(
        "classes: {low: 100, normal: 500, high: 1000, deadline: 5000}\n"
        "guarantees: {ana@lab: 4, vision: 8}\n"
        "groups: {bob@lab: vision, carol@lab: vision}\n",
        "p.yaml",
        KNOWN,
    )
    assert p.classes == (("low", 100), ("normal", 500), ("high", 1000), ("deadline", 5000))
    assert p.guarantee("ana@lab") == 4 and p.guarantee("bob@lab") == 8 and p.guarantee("dan@lab") == 0
    assert from_json(to_json(p)) == p


def test_an_empty_file_is_the_defaults() -> None:
    assert parse("", "p.yaml", KNOWN) == Policy()
    assert dict(parse("guarantees: {ana@lab: 2}", "p.yaml", KNOWN).classes) == dict(DEFAULT_CLASSES)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("classes: {high: lots}", "p.yaml:1: classes.high: expected an integer from -1000000 to 1000000, got 'lots'"),
        ("classes: {high: true}", "p.yaml:1: classes.high: expected an integer from -1000000 to 1000000, got True"),
        ("classes: {High Prio: 3}", "p.yaml:1: classes.High Prio: a class name is a short plain word"),
        ("classes: {}", "p.yaml:1: classes: expected at least one class (name: integer)"),
        ("guarantees: {ana@lab: -1}", "p.yaml:1: guarantees.ana@lab: expected an integer from 0 to 1000000, got -1"),
        ("guarantees: {ana@lab: 1.5}", "p.yaml:1: guarantees.ana@lab: expected an integer from 0 to 1000000, got 1.5"),
        ("guarantees: {anna@lab: 2}", "p.yaml:1: guarantees.anna@lab: 'anna@lab' is neither an owner the team knows"),
        ("groups: {dan@lab: vision}", "p.yaml:1: groups.dan@lab: 'dan@lab' is not an owner the team knows"),
        ("groups: {ana@lab: ''}", "p.yaml:1: groups.ana@lab: expected a group name, got an empty string"),
        ("quotas: {ana@lab: 2}", "p.yaml:1: quotas: unknown key"),
        ("- a\n- b", "p.yaml:1: (top level): expected a mapping with classes, guarantees and groups"),
        ("classes: [", "p.yaml:2: invalid YAML"),
    ],
)
def test_bad_input_is_one_line_naming_the_place(text: str, want: str) -> None:
    with pytest.raises(ValidationError) as e:
        parse(text, "p.yaml", KNOWN, "the state's history")
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(want), e.value.problems


def test_unknown_owners_say_where_the_known_ones_come_from() -> None:
    with pytest.raises(ValidationError) as e:
        parse("guarantees: {anna@lab: 2}\n", "p.yaml", KNOWN, "the state's history")
    assert e.value.problems[0].endswith("(known owners, from the state's history: ana@lab, bob@lab, carol@lab)")


def test_every_problem_at_once() -> None:
    with pytest.raises(ValidationError) as e:
        parse("classes: {high: x}\nguarantees: {ana@lab: -2}\n", "p.yaml", KNOWN)
    assert [p.split(": ")[1] for p in e.value.problems] == ["classes.high", "guarantees.ana@lab"]


def test_a_stored_policy_of_the_wrong_shape_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        from_json({"classes": {"high": "x"}})


def test_stored_in_the_team_database_and_read_where_levels_are_computed(
    postgres, monkeypatch, tmp_path, request
) -> None:
    """io/policystore against a real PostgreSQL; open_context reads it (a job's class)."""
    pytest.importorskip("psycopg")
    from provision.inventory.statebackend import Backend
    from provision.io import policystore  # here: psycopg, only for this test
    from provision.run.context import open_context

    monkeypatch.setenv("PGPASSWORD", postgres.env()["PGPASSWORD"])
    monkeypatch.setenv("PROVISION_OWNER", "ana@lab.example")
    identity.cache_clear()  # the caller is a known owner: not an earlier test's cached one
    request.addfinalizer(identity.cache_clear)
    postgres.sql("DROP TABLE IF EXISTS provision_policy")  # as a database made before priorities
    store = policystore.open_team(Backend(postgres.url(), "test"))
    try:
        assert policystore.read(store) == policystore.Stored(Policy(), False)
        assert "ana@lab.example" in policystore.known_owners(store)
        team = parse("classes: {low: 100, normal: 500, urgent: 2000}\nguarantees: {ana@lab.example: 2}", "p", None)
        policystore.write(store, team)
        got = policystore.read(store)
        assert got.set and got.policy == team and got.updated_by == "ana@lab.example"
    finally:
        store.close()
    inv = tmp_path / "j.yaml"
    inv.write_text(
        "job: prio-pg\npriority: urgent\nhosts: [{name: h1, address: 10.0.0.1}]\n"
        "pools: {chief: {replicas: 1, command: [sleep, '1']}}\n"
    )
    monkeypatch.setenv("PROVISION_STATE", postgres.url())
    ctx = open_context(str(inv), render_secrets=False)
    try:
        assert ctx.policy == team and ctx.turn.priority == 2000 and not ctx.turn.preemptible
    finally:
        ctx.close()


def test_dev_sessions_terms_default_and_as_given() -> None:
    assert parse("", "p.yaml", KNOWN).dev == DevPolicy()
    p = parse("dev: {priority: high, hours: 2.5, idle_minutes: 30, idle_below: 10}\n", "p.yaml", KNOWN)
    assert p.dev == DevPolicy("high", 2.5, 30, 10)
    assert parse("dev: {idle_minutes: 90}\n", "p.yaml", KNOWN).dev == DevPolicy(idle_minutes=90)
    assert parse("dev: {priority: 700}\n", "p.yaml", KNOWN).dev.priority == 700
    assert from_json(to_json(p)) == p
    old = {k: v for k, v in to_json(p).items() if k != "dev"}  # a policy stored before dev: existed
    assert from_json(old).dev == DevPolicy()


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("dev: {priority: urgent}", "p.yaml:1: dev.priority: expected a class of classes: (high, low, normal)"),
        ("dev: {hours: 0}", "p.yaml:1: dev.hours: expected a number > 0, got 0"),
        ("dev: {hours: 1000}", "p.yaml:1: dev.hours: at most 720, got 1000"),
        ("dev: {idle_minutes: 0}", "p.yaml:1: dev.idle_minutes: expected an integer from 1 to 10080, got 0"),
        ("dev: {idle_below: 101}", "p.yaml:1: dev.idle_below: expected an integer from 0 to 100, got 101"),
        ("dev: {idle: 5}", "p.yaml:1: dev.idle: unknown key"),
        ("classes: {low: 1}\ndev: {hours: 2}", "p.yaml:2: dev: no priority: given, and the default class 'normal'"),
    ],
)
def test_bad_dev_terms_are_one_line_each(text: str, want: str) -> None:
    with pytest.raises(ValidationError) as e:
        parse(text, "p.yaml", KNOWN)
    assert len(e.value.problems) == 1 and e.value.problems[0].startswith(want), e.value.problems
