"""The load pipeline: locate (manifest, indexes) -> read plan -> read (verified)
-> place in place / create -> report. :mod:`.pipeline` runs it."""
