//! The engine of the benchmarks: the service's task driver over a broker that
//! acknowledges everything at once, fed in poll batches.

use std::hint::black_box;

use afstream::core::{
    read_changelog, Ack, BackupBatch, BackupMarker, ControllerConfig, FailurePolicy, GlobalThresholds, Mode, Operator,
    Placement, TaskDriver, TaskIo, ThresholdPolicy,
};

/// The I/O boundary of a broker that acknowledges everything at once.
#[derive(Default)]
pub struct InstantIo {
    acks: Vec<Ack>,
}

impl<Out> TaskIo<Out> for InstantIo {
    fn send_output(&mut self, item_offset: u64, output: Out) {
        black_box(output);
        self.acks.push(Ack::Output { item_offset, count: 1 });
    }

    fn write_backup(&mut self, seq: u64, records: &BackupBatch) {
        black_box(records);
        self.acks.push(Ack::BackupWritten(seq));
    }

    fn write_marker(&mut self, marker: &BackupMarker) {
        black_box(marker.to_entry());
        self.acks.push(Ack::MarkerWritten(marker.seq));
    }

    fn commit(&mut self, offset: u64) {
        black_box(offset);
    }
}

/// One task: the service's task driver over an instant broker, fed in poll
/// batches of 500 items.
pub struct Engine<O: Operator> {
    pub driver: TaskDriver<O>,
    io: InstantIo,
    next_offset: u64,
}

const POLL: usize = 500;

impl<O: Operator> Engine<O> {
    /// One of `tasks` tasks that split the thresholds (Θ, L, Γ) between them
    /// as the service's do.
    pub fn one_of(operator: O, mode: Mode, thresholds: (f64, u64, u64), tasks: u32) -> Self {
        let (theta, items, outputs) = thresholds;
        let global = GlobalThresholds::new(theta, items, outputs).expect("valid thresholds");
        let placement = Placement {
            parallelism: tasks,
            ..Placement::default()
        };
        let constants = operator.constants();
        let policy = ThresholdPolicy::new(global, FailurePolicy::Halving, placement, operator.norm(), constants)
            .expect("policy");
        let config = ControllerConfig::new(mode, policy, constants);
        let mut io = InstantIo::default();
        let empty = read_changelog(&[]).expect("empty changelog");
        let (driver, _) = TaskDriver::recover(config, operator, &empty, None, 0, 0, &mut io).expect("start");
        let mut engine = Engine {
            driver,
            io,
            next_offset: 0,
        };
        engine.deliver();
        engine
    }

    fn deliver(&mut self) {
        while !self.io.acks.is_empty() {
            let acks = std::mem::take(&mut self.io.acks);
            for ack in &acks {
                self.driver.acknowledge(*ack, &mut self.io);
            }
        }
    }

    /// Processes `items` in poll batches; `after_poll` runs after each (a store
    /// write, say).
    #[inline]
    pub fn run(&mut self, items: &[O::Input], mut after_poll: impl FnMut(&mut TaskDriver<O>)) {
        for poll in items.chunks(POLL) {
            let mut done = 0;
            while done < poll.len() {
                let first = self.next_offset;
                let batch = poll[done..]
                    .iter()
                    .enumerate()
                    .map(|(i, item)| (first + i as u64, item));
                let taken = self.driver.process(batch, 0, &mut self.io).expect("the state reads");
                done += taken;
                self.next_offset += taken as u64;
                self.deliver();
            }
            after_poll(&mut self.driver);
            self.deliver();
        }
    }
}
