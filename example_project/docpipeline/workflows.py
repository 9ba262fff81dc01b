"""Demo workflows over a corpus every machine has: the METADATA documents of the installed Python
distributions (``importlib.metadata``).

``package-report``::

    discover -> [parse-metadata | text-stats] -> dependency-graph (async batch) -> report

``dependency-graph`` submits a real django-q2 background task, suspends, and is resumed by the
maintenance tick once the task has stored its result. ``flaky-demo`` fails its first
deliveries to show retries with back-off (its own ``retry=`` policy). ``publish-report``
drafts a report, waits for a human approval (``workflows_approve`` / ``workflows_reject``) and
publishes it if approved.

Every stage takes its input, config and output models from its annotations
(``StageContext[In, Cfg] -> Out``); a name prefix that matches no distribution is a final
business error (``StageFailed``: the run fails at once, no retry).
"""

from __future__ import annotations

import re
import uuid
from collections import Counter
from email import message_from_string
from importlib import metadata
from pathlib import Path
from typing import Any

from django.conf import settings
from pydantic import BaseModel, Field

from django_workflows import (
    CompletionCheck,
    RetryPolicy,
    StageContext,
    StageFailed,
    Suspend,
    define_async_batch_stage,
    define_workflow,
    parallel_input,
    register,
    stage,
)
from django_workflows.annotations import typed_key
from django_workflows.approval import ApprovalDecision, approval_stage
from django_workflows.conventions import Decision

WORD = re.compile(r"[a-zA-Z][a-zA-Z'-]{2,}")
STOPWORDS = frozenset(
    "the and for with that this from are you your can not use all any has have will was its "
    "but see also more other into than when which such may these they their how been our "
    "one two new using used only about must should would there then them what who where".split()
)
MAX_DESCRIPTION_CHARS = 20_000


def normalise_name(name: str) -> str:
    """PEP 503 normalised project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


# --- schemas -----------------------------------------------------------------------------------


class ReportInput(BaseModel):
    """Workflow input: which distributions to read."""

    limit: int | None = Field(default=None, ge=1, description="read at most this many")
    name_prefix: str = Field(default="", description="only names starting with this")


class Document(BaseModel):
    name: str
    version: str
    metadata_text: str


class DiscoverOutput(BaseModel):
    documents: list[Document]


class PackageInfo(BaseModel):
    name: str
    version: str
    summary: str = ""
    license: str = ""
    requires_python: str = ""
    requires: list[str] = []
    classifiers: int = 0


class ParsedMetadata(BaseModel):
    packages: list[PackageInfo]


class TextStatsConfig(BaseModel):
    top_words: int = Field(default=15, ge=1, le=100)


class TextStats(BaseModel):
    documents: int
    total_words: int
    average_words: float
    top_words: list[tuple[str, int]]
    longest: list[tuple[str, int]]


class DependencyGraph(BaseModel):
    packages: int
    edges: int
    most_depended_on: list[tuple[str, int]]
    most_dependencies: list[tuple[str, int]]
    standalone: list[str]
    missing: list[str]


class GraphConfig(BaseModel):
    poll_interval_seconds: float = Field(default=0.5, gt=0)


class ReportOutput(BaseModel):
    report_path: str
    packages: int
    edges: int
    total_words: int
    top_dependency: str | None


# --- stages ------------------------------------------------------------------------------------


@stage(id="discover", name="Discover installed distributions")
def discover(ctx: StageContext[ReportInput]) -> DiscoverOutput:
    """Read the METADATA document of every installed distribution."""
    seen: set[str] = set()
    docs: list[Document] = []
    dists = sorted(metadata.distributions(), key=lambda d: normalise_name(d.metadata["Name"] or ""))
    for dist in dists:
        name = dist.metadata["Name"] or ""
        key = normalise_name(name)
        if not name or key in seen or not key.startswith(normalise_name(ctx.input.name_prefix)):
            continue
        seen.add(key)
        text = dist.read_text("METADATA") or dist.read_text("PKG-INFO") or ""
        docs.append(Document(name=name, version=dist.version or "", metadata_text=text))
        if ctx.input.limit and len(docs) >= ctx.input.limit:
            break
    if not docs:  # a wrong prefix: retrying cannot help
        raise StageFailed(
            f"no installed distribution's name starts with {ctx.input.name_prefix!r}",
            error_type="NothingToReport",
        )
    ctx.progress(100, f"found {len(docs)} distributions")
    ctx.log("INFO", "discovered distributions", count=len(docs))
    return DiscoverOutput(documents=docs)


@stage(id="parse-metadata", name="Parse metadata headers")
def parse_metadata(ctx: StageContext[DiscoverOutput]) -> ParsedMetadata:
    """Parse each METADATA document as the RFC 822 message it is."""
    packages = []
    total = len(ctx.input.documents) or 1
    for i, doc in enumerate(ctx.input.documents, start=1):
        msg = message_from_string(doc.metadata_text)
        packages.append(
            PackageInfo(
                name=doc.name,
                version=doc.version,
                summary=msg.get("Summary", "") or "",
                license=(msg.get("License-Expression") or msg.get("License") or "")[:80],
                requires_python=msg.get("Requires-Python", "") or "",
                requires=msg.get_all("Requires-Dist") or [],
                classifiers=len(msg.get_all("Classifier") or []),
            )
        )
        if i % 10 == 0 or i == total:
            ctx.progress(100 * i / total, f"parsed {i}/{total}")
    return ParsedMetadata(packages=packages)


@stage(id="text-stats", name="Description text statistics")
def text_stats(ctx: StageContext[DiscoverOutput, TextStatsConfig]) -> TextStats:
    """Word counts over the long descriptions (the body of each METADATA document)."""
    counter: Counter[str] = Counter()
    lengths = []
    for doc in ctx.input.documents:
        body = message_from_string(doc.metadata_text).get_payload()
        words = WORD.findall(str(body)[:MAX_DESCRIPTION_CHARS].lower())
        counter.update(w for w in words if w not in STOPWORDS)
        lengths.append((doc.name, len(words)))
    total = sum(n for _, n in lengths)
    return TextStats(
        documents=len(lengths),
        total_words=total,
        average_words=round(total / len(lengths), 1) if lengths else 0.0,
        top_words=counter.most_common(ctx.config.top_words),
        longest=sorted(lengths, key=lambda x: -x[1])[:5],
    )


def compute_dependency_graph(
    run_id: str, workflow_type: str, result_key: str, packages: list[dict[str, Any]]
) -> int:
    """django-q2 background task: build the dependency graph and store it for the stage."""
    from django_workflows.blobs import DatabaseBlobStore
    from django_workflows.kernel.services import RunScopedStorage

    names = {normalise_name(p["name"]): p["name"] for p in packages}
    reverse: Counter[str] = Counter()
    forward: dict[str, set[str]] = {}
    missing: set[str] = set()
    for p in packages:
        deps = set()
        for req in p["requires"]:
            if "extra ==" in req.replace('"', "'").replace("extra==", "extra =="):
                continue  # optional dependency
            match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
            if match:
                deps.add(normalise_name(match.group(1)))
        forward[normalise_name(p["name"])] = deps
        for dep in deps:
            if dep in names:
                reverse[names[dep]] += 1
            else:
                missing.add(dep)
    graph = DependencyGraph(
        packages=len(packages),
        edges=sum(len(d) for d in forward.values()),
        most_depended_on=reverse.most_common(10),
        most_dependencies=sorted(
            ((names[k], len(v)) for k, v in forward.items()), key=lambda x: (-x[1], x[0])
        )[:10],
        standalone=sorted(names[k] for k, v in forward.items() if not v and not reverse[names[k]]),
        missing=sorted(missing),
    )
    storage = RunScopedStorage(
        DatabaseBlobStore(), workflow_type, uuid.UUID(run_id), "dependency-graph"
    )
    storage.save(result_key, graph.model_dump(mode="json"))
    return graph.edges


#: The output of the parallel group, one field per stage: ``.parse_metadata``, ``.text_stats``.
AnalysisInput = parallel_input(parse_metadata, text_stats)


def submit_graph(ctx: StageContext[AnalysisInput, GraphConfig]) -> Suspend:
    """Submit the graph computation to django-q2 and suspend until it has stored its result."""
    from django_q.tasks import async_task

    result_key = f"dependency-graph/{uuid.uuid4().hex}"
    packages = [p.model_dump() for p in ctx.input.parse_metadata.packages]
    task_id = async_task(
        "example_project.docpipeline.workflows.compute_dependency_graph",
        ctx.workflow_run_id,
        ctx.workflow_id,
        result_key,
        packages,
        q_options={"task_name": f"dependency-graph-{ctx.workflow_run_id}"},
    )
    ctx.log("INFO", "submitted dependency graph task", task_id=task_id)
    return Suspend(
        state={"batch_id": str(task_id), "result_key": result_key},
        poll_interval_seconds=ctx.config.poll_interval_seconds,
        max_wait_seconds=600,
    )


def graph_ready(state: dict[str, Any], ctx: Any) -> CompletionCheck[DependencyGraph]:
    if ctx.storage.exists(state["result_key"]):
        return CompletionCheck.done(ctx.storage.load(state["result_key"]))
    return CompletionCheck.not_ready()


dependency_graph = define_async_batch_stage(
    id="dependency-graph",
    name="Dependency graph (background task)",
    execute=submit_graph,
    check_completion=graph_ready,
    dependencies=["parse-metadata", "text-stats"],
)


@stage(
    id="report",
    name="Write the report",
    dependencies=["parse-metadata", "text-stats", "dependency-graph"],
)
def report(ctx: StageContext[DependencyGraph]) -> ReportOutput:
    """Write a Markdown report and return a summary."""
    graph = ctx.input
    parsed: ParsedMetadata = ctx.require("parse-metadata")
    stats: TextStats = ctx.require("text-stats")
    out_dir = Path(settings.DOCPIPELINE_REPORT_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"package-report-{ctx.workflow_run_id}.md"
    lines = [
        "# Installed Python distributions",
        "",
        f"Run `{ctx.workflow_run_id}`: {graph.packages} distributions, {graph.edges} "
        f"dependency edges, {stats.total_words} description words.",
        "",
        "## Most depended on",
        "",
        *[
            f"- {name}: {count} dependent{'s' if count != 1 else ''}"
            for name, count in graph.most_depended_on
        ],
        "",
        "## Most dependencies",
        "",
        *[f"- {name}: {count}" for name, count in graph.most_dependencies],
        "",
        "## Frequent description words",
        "",
        ", ".join(f"{w} ({n})" for w, n in stats.top_words),
        "",
        "## Distributions",
        "",
        "| name | version | requires-python | summary |",
        "|---|---|---|---|",
        *[
            f"| {p.name} | {p.version} | {p.requires_python} | {p.summary.replace('|', '/')} |"
            for p in parsed.packages
        ],
        "",
    ]
    if graph.missing:
        lines += ["## Required but not installed", "", ", ".join(graph.missing), ""]
    path.write_text("\n".join(lines), encoding="utf-8")
    ctx.progress(100, f"report written to {path}")
    top = graph.most_depended_on[0][0] if graph.most_depended_on else None
    return ReportOutput(
        report_path=str(path),
        packages=graph.packages,
        edges=graph.edges,
        total_words=stats.total_words,
        top_dependency=top,
    )


package_report = register(
    define_workflow(
        id="package-report",
        name="Installed package report",
        input=ReportInput,
        description="Reads the METADATA of every installed distribution and reports on it.",
    )
    .pipe(discover)
    .parallel([parse_metadata, text_stats])
    .pipe(dependency_graph)
    .pipe(report)
    .build()
)


# --- a tiny workflow that fails, then succeeds on retry ------------------------------------------


class FlakyConfig(BaseModel):
    fail_times: int = Field(default=2, ge=0, description="deliveries that fail before success")


class FlakyOutput(BaseModel):
    deliveries: int


@stage(id="flaky", name="Fails, then succeeds", retry=RetryPolicy(4, backoff_base_seconds=1))
def flaky(ctx: StageContext[Any, FlakyConfig]) -> FlakyOutput:
    """Fails its first ``fail_times`` deliveries (a retryable error), then succeeds."""
    seen = ctx.storage.load("deliveries") if ctx.storage.exists("deliveries") else 0
    ctx.storage.save("deliveries", seen + 1)
    if seen < ctx.config.fail_times:
        raise ConnectionError(f"simulated outage (delivery {seen + 1})")
    return FlakyOutput(deliveries=seen + 1)


flaky_demo = register(define_workflow(id="flaky-demo", name="Retry demo").pipe(flaky).build())


# --- publish-report: a draft, a human approval, then publishing ----------------------------------
#
#     discover -> parse-metadata -> draft -> review (human approval) -> publish
#
# ``review`` suspends until someone runs ``manage.py workflows_approve <run_id>`` (or
# ``workflows_reject``); ``publish`` copies the draft into the published folder only when it was
# approved. Every fact along the way is an annotation (``manage.py workflows_annotations``).

#: Our own typed keys (AN-50): org-prefixed, typed, documented.
DRAFT_PACKAGES = typed_key(
    "docpipeline.draft.packages",
    int,
    stability="stable",
    description="Distributions listed in the draft",
)
DRAFT_PATH = typed_key(
    "docpipeline.draft.path", str, stability="stable", description="Where the draft was written"
)
PUBLISHED_PATH = typed_key(
    "docpipeline.publish.path",
    str,
    stability="stable",
    description="Where the approved report was published",
)


class Draft(BaseModel):
    path: str
    packages: int
    top_dependency: str | None


class Published(BaseModel):
    published: bool
    path: str | None
    decided_by: str | None
    rationale: str | None


@stage(id="draft", name="Draft the report")
def draft(ctx: StageContext[ParsedMetadata]) -> Draft:
    """Write a short Markdown draft and record what it contains as annotations."""
    packages = ctx.input.packages
    dependents: Counter[str] = Counter()
    names = {normalise_name(p.name): p.name for p in packages}
    for p in packages:
        for req in p.requires:
            match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
            if match and normalise_name(match.group(1)) in names and "extra ==" not in req:
                dependents[names[normalise_name(match.group(1))]] += 1
    top = dependents.most_common(1)[0][0] if dependents else None
    out_dir = Path(settings.DOCPIPELINE_REPORT_DIR) / "drafts"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"publish-report-{ctx.workflow_run_id}.md"
    lines = [
        "# Installed distributions (draft)",
        "",
        f"{len(packages)} distributions; most depended on: {top or 'none'}.",
        "",
        *[f"- {p.name} {p.version}: {p.summary}" for p in packages],
        "",
    ]
    path.write_text("\n".join(lines), encoding="utf-8")
    ctx.annotate(DRAFT_PACKAGES, len(packages))
    ctx.annotate(DRAFT_PATH, str(path))
    ctx.annotate(Decision.outcome, "needs-review", emit_event=True)
    return Draft(path=str(path), packages=len(packages), top_dependency=top)


review = approval_stage(
    id="review",
    name="Editor review",
    description="Waits for workflows_approve / workflows_reject",
    poll_interval_seconds=1.0,
)


@stage(id="publish", name="Publish if approved", dependencies=["draft"])
def publish(ctx: StageContext[ApprovalDecision]) -> Published:
    """Copy the draft into the published folder when the review approved it."""
    decision = ctx.input
    drafted: Draft = ctx.require("draft")
    if not decision.approved:
        ctx.annotate(Decision.outcome, "not-published")
        ctx.annotate(Decision.rationale, decision.rationale or "rejected in review")
        return Published(
            published=False,
            path=None,
            decided_by=decision.decided_by,
            rationale=decision.rationale,
        )
    out_dir = Path(settings.DOCPIPELINE_REPORT_DIR) / "published"
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / Path(drafted.path).name
    target.write_text(Path(drafted.path).read_text(encoding="utf-8"), encoding="utf-8")
    ctx.annotate(Decision.outcome, "published")
    ctx.annotate(PUBLISHED_PATH, str(target), emit_event=True)
    return Published(
        published=True,
        path=str(target),
        decided_by=decision.decided_by,
        rationale=decision.rationale,
    )


publish_report = register(
    define_workflow(
        id="publish-report",
        name="Publish a package report after review",
        input=ReportInput,
        description="Drafts a package report, waits for a human approval, then publishes it.",
    )
    .pipe(discover)
    .pipe(parse_metadata)
    .pipe(draft)
    .pipe(review)
    .pipe(publish)
    .build()
)
