"""Run-directory I/O (atomic writes, markers, registry) and ZeroMQ helpers."""
