"""Facts every process of the project agrees on, written once: the dotted key=value override parser, the loopback
host names, the LoRA-slot formula. Imports nothing from the project, so the trainer, the gateway, the service and
the launcher may all import it without crossing a process boundary (what crosses one stays HTTP or a file)."""
