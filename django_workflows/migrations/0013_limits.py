"""Shared limits (issue 18 item 6): the run's concurrency key and the index of its count."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("django_workflows", "0012_generation")]

    operations = [
        migrations.AddField(
            model_name="workflowrun",
            name="concurrency_key",
            field=models.CharField(blank=True, max_length=200, null=True),
        ),
        migrations.AddIndex(
            model_name="workflowrun",
            index=models.Index(
                fields=["workflow_id", "concurrency_key", "status"], name="wf_run_concurrency_idx"
            ),
        ),
    ]
