"""The long-context suite (`kvmem eval`, `make bench`): synthetic and QA tasks (`tasks`), every method x keep ratio on
one prefill per sample (`runner`), the report with CIs (`scores`, `cost`, `race_tables`, `report`), and the race against
kvpress on the same token ids (`race`, `kvpress_runner` in kvpress's own virtualenv)."""
