"""A local service that speaks the tinker SDK's HTTP protocol: the unmodified SDK trains LoRA adapters on this
machine's model, several training clients on one base (`bash launch.sh service`)."""
