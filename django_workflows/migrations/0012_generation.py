# One word per concept (issue 17 section 3): the rerun counter of stage records and
# annotations is ``generation`` (SPEC SM-30 calls it ``attempt``); ``attempt`` is left to a
# job's delivery number (SM-31). Columns and the annotation index are renamed in place, so
# no data is copied; ``WorkflowRun.error`` documents written before this migration have their
# ``"attempt"`` member rewritten to ``"generation"`` (``"delivery"`` stays).

from django.db import migrations, models

_BATCH = 500


def _rename_error_key(apps, old: str, new: str) -> None:
    WorkflowRun = apps.get_model("django_workflows", "WorkflowRun")
    batch = []
    for run in (
        WorkflowRun.objects.filter(error__has_key=old)
        .only("id", "error")
        .iterator(chunk_size=_BATCH)
    ):
        error = dict(run.error)
        error[new] = error.pop(old)
        run.error = error
        batch.append(run)
        if len(batch) >= _BATCH:
            WorkflowRun.objects.bulk_update(batch, ["error"])
            batch = []
    if batch:
        WorkflowRun.objects.bulk_update(batch, ["error"])


def forwards(apps, schema_editor) -> None:
    _rename_error_key(apps, "attempt", "generation")


def backwards(apps, schema_editor) -> None:
    _rename_error_key(apps, "generation", "attempt")


class Migration(migrations.Migration):
    dependencies = [
        ("django_workflows", "0011_definition_versions"),
    ]

    operations = [
        migrations.RenameField(
            model_name="workflowstage",
            old_name="attempt",
            new_name="generation",
        ),
        # The database renames the index, then the column (the column rename carries the
        # index along, on PostgreSQL and SQLite alike; renaming the index first keeps SQLite's
        # drop-and-recreate of an index on a column that still exists). RenameField does not
        # rewrite Index.fields in the migration state, so the state drops the old index and
        # adds the new one instead.
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RenameIndex(
                    model_name="workflowannotation",
                    new_name="wf_ann_run_generation_idx",
                    old_name="wf_ann_run_attempt_idx",
                ),
                migrations.RenameField(
                    model_name="workflowannotation",
                    old_name="attempt",
                    new_name="generation",
                ),
            ],
            state_operations=[
                migrations.RemoveIndex(
                    model_name="workflowannotation",
                    name="wf_ann_run_attempt_idx",
                ),
                migrations.RenameField(
                    model_name="workflowannotation",
                    old_name="attempt",
                    new_name="generation",
                ),
                migrations.AddIndex(
                    model_name="workflowannotation",
                    index=models.Index(
                        fields=["run", "generation", "created_at"],
                        name="wf_ann_run_generation_idx",
                    ),
                ),
            ],
        ),
        migrations.RunPython(forwards, backwards),
    ]
