from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("django_workflows", "0012_generation"),
    ]

    operations = [
        migrations.AddField(
            model_name="workflowstage",
            name="skip_reason",
            field=models.TextField(blank=True, default=""),
        ),
    ]
