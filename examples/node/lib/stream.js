'use strict';
// One UpdateWeights call (a bidirectional stream) as a few awaitable steps.

const { once } = require('events');

class UpdateStream {
  constructor(client, metadata) {
    this.call = client.UpdateWeights(metadata);
    this.responses = [];
    this.waiters = [];
    this.applied = 0; // bucket_applied messages seen
    this.aborting = null; // the server's UpdateAborting, once it sent one
    this.error = null; // the call's error status, once it ended with one
    this.finished = false;
    this.drain = null; // set while write() back-pressure is pending
    /** The call's final status ({code, details, metadata}), whatever it is. */
    this.ended = new Promise((resolve) => this.call.on('status', resolve));
    this.call.on('data', (response) => {
      if (response.message === 'bucketApplied') this.applied += 1;
      else if (response.message === 'aborting') this.aborting = response.aborting;
      this.responses.push(response);
      this.wake();
    });
    this.call.on('error', (error) => {
      this.error = error;
      this.wake();
    });
    this.call.on('end', () => {
      this.finished = true;
      this.wake();
    });
  }

  wake() {
    for (const waiter of this.waiters.splice(0)) waiter();
  }

  async changed() {
    await new Promise((resolve) => this.waiters.push(resolve));
  }

  /**
   * Write one message, honouring gRPC flow control: once write() said the buffer is full, nothing
   * more is written before 'drain' (or the end of the call: then its error is thrown). The wait
   * happens at the next write, not at once: meanwhile the caller reads the next bucket from the
   * file while gRPC sends this one. `written` runs once gRPC took the message (it no longer
   * reads the buffer).
   */
  async write(message, written = undefined) {
    await this.drained();
    if (!this.call.write(message, written)) {
      this.drain = Promise.race([once(this.call, 'drain'), this.ended]);
      this.drain.catch(() => {}); // an 'error' instead of 'drain' is thrown at the next write
    }
  }

  /** Until the last write's back-pressure cleared; throws the call's error if it ended with one. */
  async drained() {
    if (this.drain) {
      const drain = this.drain;
      this.drain = null;
      await drain;
    }
    if (this.error) throw this.error;
  }

  /** The next response of kind `kind` ('ready', 'committed'); bucket_applied ones are counted. */
  async next(kind) {
    for (;;) {
      const index = this.responses.findIndex((r) => r.message === kind);
      if (index >= 0) return this.responses.splice(index, 1)[0][kind];
      if (this.aborting) throw await this.failure();
      if (this.error) throw this.error;
      if (this.finished) throw new Error(`the UpdateWeights stream ended before ${kind}`);
      await this.changed();
    }
  }

  /** Until `count` buckets were applied; false if the update failed first. */
  async appliedAtLeast(count) {
    while (this.applied < count) {
      if (this.aborting || this.error || this.finished) return false;
      await this.changed();
    }
    return true;
  }

  /** After `aborting`: what docs/data-plane.md asks (send abort, nothing more), then the call's
   * error status, which carries the ErrorInfo. */
  async failure() {
    if (!this.error && !this.finished) {
      this.call.write({ abort: { reason: `the server sent aborting: ${this.aborting.reason}` } });
      this.call.end();
    }
    const status = await this.ended;
    return this.error || new Error(`update aborted: ${this.aborting.reason}: ${this.aborting.message} (status ${status.code})`);
  }

  /** Abandon the update: an `abort` message (or, with `cancel`, drop the call); returns the final status. */
  async abandon(reason, { cancel = false } = {}) {
    if (cancel) this.call.cancel();
    else if (!this.error && !this.finished) {
      this.call.write({ abort: { reason } });
      this.call.end();
    }
    return this.ended;
  }

  /** Half-close after commit; the status must be OK. */
  async close() {
    this.call.end();
    const status = await this.ended;
    if (status.code !== 0) throw this.error || new Error(`UpdateWeights ended with status ${status.code}: ${status.details}`);
  }
}

module.exports = { UpdateStream };
