"""`registry verify-entry` and `registry audit`: the verifiable log checked from outside
(docs/transparency.md). Every check is the client's own (registry/transparency.py's RFC 9162
verification and C2SP note parsing); the registry's word is taken for nothing but the bytes it
serves."""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cli.client import RegistryClient, RegistryClientError
from cli.main import EXIT_USAGE, CliError
from registry.did import public_key_from_did_key
from registry.transparency import (
    Checkpoint,
    CompactRange,
    check_version,
    open_checkpoint,
    record_leaf,
    verify_consistency,
    verify_inclusion,
)

PAGE = 1000


class AuditFailure(Exception):
    """The log is not what its checkpoints say: the report, and the evidence to keep."""

    def __init__(self, report: str, evidence: dict[str, Any]) -> None:
        super().__init__(report)
        self.report = report
        self.evidence = evidence


def _key_of(did: str) -> bytes:
    try:
        return public_key_from_did_key(did)
    except ValueError:
        raise CliError(
            f"the checkpoint's signer {did!r} is not an Ed25519 did:key: give --registry-did",
            EXIT_USAGE,
        ) from None


def signer_of(note: str, registry_did: str | None) -> str:
    """The DID whose key must sign `note`: the one given, else the origin line when it is a
    did:key (the registry's default origin; trusted on first use)."""
    return registry_did or note.split("\n", 1)[0]


def _b64(items: list[str]) -> list[bytes]:
    return [base64.b64decode(item, validate=True) for item in items]


@contextmanager
def _reading(what: str, evidence: dict[str, Any]) -> Iterator[None]:
    """A malformed answer of the registry (a missing member, a wrong type, bad base64) is a
    failed check with its evidence, as any other inconsistency: never a bug of the monitor."""
    try:
        yield
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        reason = f"{exc.__class__.__name__}: {exc}"
        raise AuditFailure(f"the registry's {what} is malformed ({reason})", evidence) from None


# --- verify-entry ------------------------------------------------------------------------------


def verify_entry(
    client: RegistryClient, did: str, sequence: int | None, registry_did: str | None
) -> list[str]:
    """Check one entry version against the log: what held, or AuditFailure."""
    if sequence is None:
        sequence = int(client.get(did)["sequence"])
    bundle = client.version_proof(did, sequence)
    with _reading("proof bundle", {"bundle": bundle}):
        note, record, proof = bundle["checkpoint"], bundle["record"], bundle["proof"]
        if not isinstance(note, str):
            raise TypeError("its checkpoint is not text")
        signer = signer_of(note, registry_did)
    try:
        checkpoint = open_checkpoint(note, _key_of(signer))
    except ValueError as exc:
        raise AuditFailure(f"the checkpoint does not hold: {exc}", {"bundle": bundle}) from None
    problems = []
    with _reading("proof bundle", {"bundle": bundle}):
        if record.get("sequence") != sequence or record.get("subject") != did:
            problems.append(f"the record is not version {sequence} of {did}")
        if proof.get("treeSize") != checkpoint.size or proof.get("leafIndex") != sequence - 1:
            problems.append("the proof is not for this record in this checkpoint")
        elif not verify_inclusion(
            sequence - 1,
            checkpoint.size,
            record_leaf(record),
            _b64(proof["proof"]),
            checkpoint.root,
        ):
            problems.append("the inclusion proof does not lead to the checkpoint's root")
    version = client.version(did, sequence)
    with _reading("entry version", {"bundle": bundle, "version": version}):
        problems += check_version(record, version)
    if problems:
        raise AuditFailure("; ".join(problems), {"bundle": bundle})
    return [
        f"version {sequence} of {did} is record {sequence} of the log",
        f"included in checkpoint {checkpoint.size} of {checkpoint.origin}, signed by {signer}",
        "its documentHash and its publisher's signature hold",
    ]


# --- audit -------------------------------------------------------------------------------------


@dataclass
class AuditState:
    """What a monitor keeps between runs: the last checkpoint it verified and the compact range
    of that tree (enough to extend it with the next records)."""

    url: str
    signer: str = ""
    origin: str = ""
    note: str = ""
    size: int = 0
    hashes: list[str] = field(default_factory=list)
    versions_checked: int = 0

    @classmethod
    def load(cls, path: Path, url: str) -> AuditState:
        """The state kept in `path` (a new one if there is none). The log it follows is named
        by its signer and origin, not by the URL: a registry that moved is followed on."""
        if not path.exists():
            return cls(url)
        try:
            data = json.loads(path.read_text())
            state = cls(**{**data, "url": url})
            CompactRange(state.size, _b64(state.hashes))
        except (OSError, ValueError, TypeError) as exc:
            raise CliError(
                f"{path} is not a monitor's state ({exc}); give another --state", EXIT_USAGE
            ) from None
        return state

    def save(self, path: Path) -> None:
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(json.dumps(self.__dict__, indent=2) + "\n")
        os.replace(temporary, path)  # a crash leaves the old state or the new one


def audit_once(client: RegistryClient, state: AuditState, registry_did: str | None) -> str:
    """One pass: the newest checkpoint verified against the last one and against every record
    since; the new state on success (in `state`), AuditFailure at the first inconsistency."""
    note = client.checkpoint()
    signer = registry_did or state.signer or signer_of(note, None)
    if state.signer and signer != state.signer:
        raise AuditFailure(
            f"the checkpoint must be signed by {state.signer}, which this monitor followed",
            {"checkpoint": note},
        )
    pinned = state.origin or None  # the log this monitor follows: its key name and origin
    try:
        checkpoint = open_checkpoint(note, _key_of(signer), pinned, origin=pinned)
    except ValueError as exc:
        raise AuditFailure(f"the checkpoint does not hold: {exc}", {"checkpoint": note}) from None
    evidence: dict[str, Any] = {"previous": state.note, "checkpoint": note}
    old = CompactRange(state.size, _b64(state.hashes))
    if state.note:
        _consistent(client, state, old.root(), checkpoint, evidence)
    tree = CompactRange(old.size, list(old.hashes))
    checked = unserved = 0
    while tree.size < checkpoint.size:
        page = client.log_records(tree.size + 1, min(PAGE, checkpoint.size - tree.size))
        with _reading("records page", {**evidence, "records": page}):
            records = page["records"]
            if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
                raise TypeError("its records are not a list of objects")
        if not records:
            raise AuditFailure(
                f"the registry serves no record {tree.size + 1} below its checkpoint's size",
                evidence,
            )
        for record in records[: checkpoint.size - tree.size]:
            if record.get("sequence") != tree.size + 1:
                raise AuditFailure(f"record {tree.size + 1} is missing from the records", evidence)
            with _reading("record", {**evidence, "record": record}):
                tree.append(record_leaf(record))
            if "documentHash" in record:  # only public entry records carry one
                done = _check_version(client, record, evidence)
                checked += done
                unserved += 1 - done
    if tree.root() != checkpoint.root:
        raise AuditFailure(
            f"the records 1..{checkpoint.size} do not hash to checkpoint {checkpoint.size}'s root:"
            " the log served is not the log the registry signed",
            evidence,
        )
    added = checkpoint.size - state.size
    state.signer, state.origin, state.note = signer, checkpoint.origin, note
    state.size, state.hashes = tree.size, [base64.b64encode(h).decode() for h in tree.hashes]
    state.versions_checked += checked
    return (
        f"checkpoint {checkpoint.size} of {checkpoint.origin} verified: {added} new records,"
        f" {checked} entry versions checked"
        + (f", {unserved} no longer served" if unserved else "")
    )


def _consistent(
    client: RegistryClient,
    state: AuditState,
    old_root: bytes,
    checkpoint: Checkpoint,
    evidence: dict[str, Any],
) -> None:
    if checkpoint.size < state.size:
        raise AuditFailure(
            f"the log shrank from {state.size} to {checkpoint.size} records (a rollback)", evidence
        )
    if checkpoint.size == state.size:
        if checkpoint.root != old_root:
            raise AuditFailure(f"two different roots for tree size {state.size}: a fork", evidence)
        return
    if state.size == 0:
        return
    proof = client.consistency_proof(state.size, checkpoint.size)
    evidence["proof"] = proof
    with _reading("consistency proof", evidence):
        path = _b64(proof["proof"])
    if not verify_consistency(state.size, checkpoint.size, path, old_root, checkpoint.root):
        raise AuditFailure(
            f"checkpoint {checkpoint.size} is not consistent with checkpoint {state.size}:"
            " a fork, or history rewritten",
            evidence,
        )


NOT_SERVED = frozenset({"version_not_found", "entry_not_found"})


def _check_version(client: RegistryClient, record: dict[str, Any], evidence: dict[str, Any]) -> int:
    """1 when the record's version was checked; 0 when the registry no longer serves it (a
    deleted entry's versions, a deletion's version: docs/lifecycle.md)."""
    subject = record.get("subject")
    if not isinstance(subject, str):
        raise AuditFailure(
            f"record {record['sequence']} has a documentHash but no entry DID as its subject",
            {**evidence, "record": record},
        )
    try:
        version = client.version(subject, int(record["sequence"]))
    except RegistryClientError as exc:
        if exc.code in NOT_SERVED:
            return 0
        raise
    with _reading("entry version", {**evidence, "record": record, "version": version}):
        problems = check_version(record, version)
    if problems:
        raise AuditFailure(
            f"record {record['sequence']} ({record['subject']}): {'; '.join(problems)}",
            {**evidence, "record": record, "version": version},
        )
    return 1


def cmd_audit(args: argparse.Namespace) -> int:
    state_path = Path(args.state)
    state = AuditState.load(state_path, args.url)
    with RegistryClient(args.url) as client:
        while True:
            try:
                line = audit_once(client, state, args.registry_did)
            except AuditFailure as failure:
                _report(failure)
                return 1
            state.save(state_path)
            print(line, flush=True)
            if not args.follow:
                return 0
            time.sleep(args.interval)


def cmd_verify_entry(args: argparse.Namespace) -> int:
    with RegistryClient(args.url) as client:
        try:
            lines = verify_entry(client, args.did, args.sequence, args.registry_did)
        except AuditFailure as failure:
            _report(failure)
            return 1
    for line in lines:
        print(f"ok: {line}")
    return 0


def _report(failure: AuditFailure) -> None:
    print(f"FAILED: {failure.report}")
    print("evidence:")
    print(json.dumps(failure.evidence, indent=2, ensure_ascii=False))
    sys.stdout.flush()
