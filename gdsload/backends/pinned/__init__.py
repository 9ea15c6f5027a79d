"""The pinned backend (:mod:`.backend`): reads staged in pinned host memory, copied to the device on streams of
its own, by one of two readers: the native stager's (:mod:`.native_reader`), or Python threads filling the
staging pool's slots (:mod:`.slot_readers`, :mod:`.staging_pool`). Nothing is imported here, so a module of the
room is imported alone."""
