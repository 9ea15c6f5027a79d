"""The native stager (:mod:`.stager`): the C library (``_stage.c``), built at install or at first use and
loaded with ctypes, whose threads read files into pinned buffers and copy them to the device; the pinned
backend's default reader and the mmap backend's copier run on it. Nothing is imported here."""
