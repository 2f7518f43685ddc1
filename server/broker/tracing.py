"""The broker owns the trace settings (Triton's trace extension; see shm/trace.py).

It keeps the global setting and each model's overrides, gives every setting object a slot of
counters in the shared trace segment (a fresh slot when a setting changes, so its sample and count
start again as Triton's new TraceSetting objects do), and publishes what the frontends need:
for the global setting and each model with overrides, the effective values and their slots.
"""
from __future__ import annotations

import logging
from typing import Any

import orjson

from shmserve.shm import trace
from shmserve.shm.trace import TraceShared
from shmserve.signature import InvalidRequest

log = logging.getLogger("shmserve.trace")


class TraceOwner:
    def __init__(self, server_id: str, flags: dict[str, Any], shown: str = "") -> None:
        self.shared = TraceShared.create(server_id)
        self.start_file: str = flags.get("file", "")
        # The trace file as the flag named it, relative or not (Triton shows it so), and each
        # owner's ("" or a model) as its last POST named it: (name, path) while the path is its file
        self.start_name = shown or self.start_file
        self.names: dict[str, tuple[str, str]] = {}
        self.global_: dict[str, Any] = {**trace.DEFAULTS, **flags}
        self.start = dict(self.global_)  # what a global key cleared with null goes back to
        self.overrides: dict[str, dict[str, Any]] = {}  # model -> the keys it sets itself
        self.objects: dict[str, tuple[int, int]] = {}  # "" (global) or model -> (slot, serial)
        self.files: dict[str, tuple[int, int]] = {}  # path -> (file slot, serial)
        self.serial = 0
        self._new_object("", self.global_)
        self._publish()

    # -- slots ------------------------------------------------------------------------------------
    def _new_object(self, owner: str, setting: dict[str, Any]) -> None:
        """A new setting object: a free slot, reset with the setting's count (under the lock)."""
        used = {slot for slot, _ in self.objects.values()} - {self.objects.get(owner, (-1, 0))[0]}
        slot = next((i for i in range(trace.SLOTS) if i not in used), None)
        if slot is None:
            raise InvalidRequest(f"too many models with their own trace settings (at most {trace.SLOTS - 1})")
        self.serial += 1
        self._file(setting["file"])
        self.shared.take_over()
        try:
            self.shared.slots[slot] = (self.serial, setting["count"], 0, 0)
        finally:
            self.shared.unlock()
        self.objects[owner] = (slot, self.serial)

    def _file(self, path: str) -> None:
        if not path or path in self.files:
            return
        if len(self.files) >= trace.FILES:
            raise InvalidRequest(f"too many trace files (at most {trace.FILES} in one server's life)")
        fslot = len(self.files)
        self.serial += 1
        self.shared.take_over()
        try:
            self.shared.files[fslot] = (self.serial, 0, 0, 0)
        finally:
            self.shared.unlock()
        self.files[path] = (fslot, self.serial)

    def remaining(self, owner: str) -> int:
        slot, serial = self.objects[owner]
        row = self.shared.slots[slot]
        return int(row[1]) if int(row[0]) == serial else 0

    # -- settings ---------------------------------------------------------------------------------
    def setting(self, model: str) -> dict[str, Any]:
        return trace.effective(self.global_, self.overrides.get(model))

    def _owner(self, model: str) -> str:
        return model if model in self.overrides else ""

    def answer(self, model: str) -> dict[str, Any]:
        doc = trace.triton_doc(self.setting(model), self.remaining(self._owner(model)))
        if "trace_file" in doc:  # (not in OpenTelemetry mode)
            doc["trace_file"] = self._file_name(model, doc["trace_file"])
        return doc

    def _file_name(self, model: str, path: str) -> str:
        """``path``, ``model``'s trace file, as whoever set it named it."""
        owner = model if "file" in self.overrides.get(model, {}) else ""
        name, named = self.names.get(owner, ("", ""))
        if name and named == path:
            return name
        return self.start_name if path == self.start_file else path

    def handle(self, model: str, changes: dict[str, Any] | None) -> tuple[int, dict[str, Any]]:
        """GET (no ``changes``) or POST ``v2[/models/<model>]/trace/setting``. A ``trace_file``
        posted as a GET shows it (the flag's name is relative to where the server started, not
        to the start-up file's directory as other names are) names that file."""
        if changes is not None:
            name = changes.get("trace_file")
            current = self.setting(model)["file"]
            known = {self.start_name: self.start_file, self._file_name(model, current): current}
            if isinstance(name, str) and name in known:
                changes = {**changes, "trace_file": known[name]}
            try:
                update = trace.check_update(changes, model, self.setting(model), self.start_file, self.start)
            except ValueError as e:
                raise InvalidRequest(str(e)) from None
            self._apply(model, update)
            if isinstance(name, str) and update.get("file"):
                self.names[model] = (name, update["file"])
        return 200, self.answer(model)

    @staticmethod
    def _check(setting: dict[str, Any]) -> None:
        """Triton's rule: a setting may be invalid only if it disables tracing. A count of 0 is
        invalid too (Triton's ``TraceSetting::Valid``), whichever POST left it there: one that
        sets it, or one that turns the level on where it was set under OFF or ran out."""
        if setting["level"] == "OFF":
            return
        if setting["rate"] == 0:  # (Triton's order)
            raise InvalidRequest(trace.RATE_ZERO)
        if setting["mode"] == "triton" and not setting["file"]:
            raise InvalidRequest("Attempting to set invalid trace setting :trace file name is not given")  # Triton's
        if setting["count"] == 0:
            raise InvalidRequest("Attempting to set invalid trace setting : a trace_count of 0 traces nothing while "
                                 "trace_level is on (-1: no limit; or set trace_level OFF)")

    def _apply(self, model: str, update: dict[str, Any]) -> None:
        if not update:
            return
        if not model:
            # Keys the update leaves alone keep their values, the count what is left of it.
            new = {**self.global_, "count": self.remaining(""), **update}
            # Models that fall back on global keys follow them, each with what its own count has
            # left (or the global one's), and must be valid too.
            followers = {name: {**trace.effective(new, own), "count": self._model_count(name, own, new)}
                         for name, own in self.overrides.items() if any(k not in own for k in trace.MODEL_KEYS)}
            self._check(new)
            for setting in followers.values():
                self._check(setting)
            self.global_ = new
            self._new_object("", new)
            for name, setting in followers.items():
                self._new_object(name, setting)
        else:
            own = dict(self.overrides.get(model, {}))
            if "count" not in update and "count" in own and model in self.overrides:
                own["count"] = self.remaining(model)
            for key, value in update.items():
                if value is None:
                    own.pop(key, None)
                else:
                    own[key] = value
            if not own:
                self.overrides.pop(model, None)  # no key of its own: the model uses the global object
                self.objects.pop(model, None)
            else:
                setting = trace.effective(self.global_, own)
                if "count" not in own:
                    setting["count"] = self.remaining("")  # what the global object has left, as Triton
                self._check(setting)
                self.overrides[model] = own
                self._new_object(model, setting)
        log.info("trace settings of %s: %s", f"model '{model}'" if model else "the server",
                 orjson.dumps(self.answer(model)).decode())
        self._publish()

    def _model_count(self, model: str, own: dict[str, Any], global_: dict[str, Any]) -> int:
        """The count a model's new setting object starts with: what its own has left, or the
        global setting's count."""
        return self.remaining(model) if "count" in own else global_["count"]

    def _publish(self) -> None:
        def entry(owner: str, setting: dict[str, Any]) -> dict[str, Any]:
            slot, serial = self.objects[owner]
            fslot, fserial = self.files.get(setting["file"], (0, 0))
            return {**setting, "slot": slot, "serial": serial, "fslot": fslot, "fserial": fserial}

        doc = {"global": entry("", self.global_),
               "models": {m: entry(m, self.setting(m)) for m in self.overrides}}
        self.shared.doc.publish(orjson.dumps(doc))

    # -- a broker restart ---------------------------------------------------------------------------
    def saved(self) -> dict[str, Any]:
        """The settings to journal (server/broker/journal.py): the global one and each model's own keys."""
        return {"global": self.global_, "overrides": self.overrides, "names": self.names}

    def restore(self, saved: dict[str, Any]) -> None:
        """Take the settings a broker before this one had. Each setting object starts again with
        the count it had at its last change (the counters lived in the dead broker's segment)."""
        start = (self.global_, self.overrides)
        self.global_ = {**self.global_, **saved.get("global", {})}
        self.overrides = {m: dict(own) for m, own in saved.get("overrides", {}).items()}
        self.names.update({owner: (name, path) for owner, (name, path) in saved.get("names", {}).items()})
        try:
            self._new_object("", self.global_)
            for name, own in self.overrides.items():
                self._new_object(name, trace.effective(self.global_, own))
        except InvalidRequest as e:  # e.g. more trace files than slots: keep the start settings
            log.error("trace settings not restored after a broker restart: %s", e)
            self.global_, self.overrides = start
            self.objects = {}
            self._new_object("", self.global_)  # its file is known already: this cannot fail
            self._publish()
            return
        log.info("restored the trace settings after a broker restart")
        self._publish()

    def close(self) -> None:
        """At exit (frontends have stopped): close the JSON arrays still open, remove the segment."""
        trace.finish_files(self.shared, self.files)
        self.shared.close()
        self.shared.unlink()
